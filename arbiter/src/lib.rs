//! A device's scheduling, apart from every tenant's data: the scheduler
//! that hands out a device's lanes ([`sched`]: weights, caps, priority
//! classes, preemption), the grants that carry its decisions to tenant
//! executors in other processes ([`grant`]), the arbiter process that holds
//! it ([`arbiter`]), and the line protocol the control plane speaks to
//! every device process ([`ipc`]).
//!
//! Nothing here maps tenant memory or opens a tenant's socket; the crate
//! depends on no executor or control-plane code.

pub mod arbiter;
pub mod fatal;
pub mod grant;
pub mod ipc;
pub mod nice;
pub mod placement;
pub mod sched;
