//! Issue 14: the device worker shares its lanes between saturating tenants
//! in proportion to their weights (weighted fair sharing by stride on
//! measured device time). share-bench prints the same figures with their
//! error; the tolerance here is wide enough never to flake on a loaded
//! machine.

use vgpu_tests::{shares, Mediator};

#[test]
fn saturating_tenants_get_device_time_in_proportion_to_their_weights() {
    let m = Mediator::start(&["--device-memory", "256MiB"]);
    let (got, _) = shares::measure(&m, "w", &[1, 3], 1.5, 20_000);
    assert!((got[0] - 0.25).abs() < 0.08 && (got[1] - 0.75).abs() < 0.08, "1:3 gave {got:?}");
    let (got, _) = shares::measure(&m, "v", &[1, 1, 2, 4], 1.5, 20_000);
    for (g, want) in got.iter().zip([0.125, 0.125, 0.25, 0.5]) {
        assert!((g - want).abs() < 0.08, "1:1:2:4 gave {got:?}");
    }
}
