//! A device's arbiter process: the device's scheduler and nothing of any
//! tenant's. It decides which tenant's executor runs on which lane
//! ([`crate::grant`]): weights, caps, priority classes and preemption, as
//! one process's scheduler would, across processes. It opens no tenant
//! socket, maps no tenant memory and holds no device context.
//!
//! The control plane drives it over stdin/stdout like a worker
//! ([`crate::ipc`]: `AddTenant` and `SetTenant` set a tenant's share,
//! `RemoveTenant` forgets it, `Stats` answers the device's lane time), and
//! hands it each executor's end of a grant channel over the datagram
//! socket at [`INTAKE_FD`]: the tenant's name, with the descriptor
//! attached.

use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::UnixDatagram;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tracing::{info, warn};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use crate::grant::{Channel, Served};
use crate::ipc::{CmdLine, DeviceStats, MsgLine, TenantStats, WorkerCmd, WorkerMsg};
use crate::sched::{Scheduler, WeightedFair};

/// The descriptor the arbiter receives executors' grant channels on.
pub const INTAKE_FD: i32 = 3;
/// The longest tenant name an intake message carries.
pub const MAX_NAME: usize = 256;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What the arbiter knows of one tenant: its share and its executor's
/// lane time.
#[derive(Default)]
struct Known {
    share: crate::sched::Share,
    served: Arc<Served>,
}

/// Hands `chan` (an executor's end of its grant channel) to the arbiter
/// listening on `intake`, for `tenant`.
pub fn hand_over(intake: &UnixDatagram, tenant: &str, chan: &OwnedFd) -> std::io::Result<()> {
    if tenant.len() > MAX_NAME {
        return Err(std::io::Error::other("tenant name too long"));
    }
    intake.send_with_fd(tenant.as_bytes(), std::os::fd::AsRawFd::as_raw_fd(chan)).map(|_| ()).map_err(|e| std::io::Error::from_raw_os_error(e.errno()))
}

/// Runs the arbiter until the control plane closes its stdin. `desc` is
/// the device as tenants see it, for the statistics.
pub fn run(lanes: usize, desc: (String, String, String, u64, u64)) -> anyhow::Result<()> {
    let (kind, name, uuid, memory, spill_budget) = desc;
    let sched = Scheduler::new(lanes, Arc::new(WeightedFair::new(lanes)));
    let known: Arc<Mutex<HashMap<String, Known>>> = Arc::default();
    // SAFETY: the control plane passes the intake socket at INTAKE_FD to
    // this process alone.
    let intake = unsafe { UnixDatagram::from_raw_fd(INTAKE_FD) };
    let (s2, k2) = (sched.clone(), known.clone());
    std::thread::Builder::new().name("intake".into()).spawn(move || take_executors(&intake, &s2, &k2))?;
    let started = Instant::now();
    let out = std::io::stdout();
    let send = |id: u64, msg: WorkerMsg| -> std::io::Result<()> {
        let line = serde_json::to_string(&MsgLine { id, msg }).map_err(std::io::Error::other)? + "\n";
        let mut o = out.lock();
        o.write_all(line.as_bytes())?;
        o.flush()
    };
    send(0, WorkerMsg::Ready { pid: std::process::id() })?;
    info!(lanes, "device arbiter ready");
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        let (id, cmd) = match serde_json::from_str::<CmdLine>(&line) {
            Ok(c) => (c.id, c.cmd),
            Err(e) => {
                send(0, WorkerMsg::Err(format!("bad command: {e}")))?;
                continue;
            }
        };
        let reply = match cmd {
            WorkerCmd::AddTenant(spec) => {
                sched.configure(&spec.name, spec.share());
                lock(&known).entry(spec.name).or_default().share = spec.share();
                WorkerMsg::Ok
            }
            WorkerCmd::SetTenant { name, share, .. } => {
                if let Some(sh) = share {
                    sched.configure(&name, sh);
                    lock(&known).entry(name).or_default().share = sh;
                }
                WorkerMsg::Ok
            }
            WorkerCmd::RemoveTenant { name } => {
                sched.forget(&name);
                lock(&known).remove(&name);
                WorkerMsg::Ok
            }
            WorkerCmd::RetireIfIdle { .. } => WorkerMsg::Err("an arbiter serves no clients: ask the tenant's executor".into()),
            WorkerCmd::Stats => WorkerMsg::Stats(DeviceStats {
                kind: kind.clone(),
                name: name.clone(),
                uuid: uuid.clone(),
                memory,
                busy_ns: sched.busy().as_nanos() as u64,
                uptime_ns: started.elapsed().as_nanos() as u64,
                lanes: lanes as u32,
                spill_budget,
                tenants: lock(&known)
                    .iter()
                    .map(|(n, k)| TenantStats {
                        name: n.clone(),
                        device_ns: k.served.lane_ns.load(Ordering::Relaxed),
                        weight: k.share.weight,
                        cap: k.share.cap,
                        priority: k.share.priority,
                        ..TenantStats::default()
                    })
                    .collect(),
                ..DeviceStats::default()
            }),
        };
        send(id, reply)?;
    }
    Ok(())
}

/// Receives executors' grant channels and serves each on a thread of its
/// own until the executor goes.
fn take_executors(intake: &UnixDatagram, sched: &Scheduler, known: &Arc<Mutex<HashMap<String, Known>>>) {
    let mut buf = [0u8; MAX_NAME];
    loop {
        let (n, file) = match intake.recv_with_fd(&mut buf) {
            Ok(r) => r,
            Err(e) => {
                warn!("the executor intake failed ({e}); no more executors can join");
                return;
            }
        };
        if n == 0 && file.is_none() {
            // The control plane is gone.
            return;
        }
        let Some(file) = file else {
            warn!("an intake message without a grant channel");
            continue;
        };
        let Ok(tenant) = std::str::from_utf8(&buf[..n]).map(str::to_string) else {
            warn!("an intake message with a tenant name that is not UTF-8");
            continue;
        };
        let served = lock(known).entry(tenant.clone()).or_default().served.clone();
        let chan = Channel::from_fd(OwnedFd::from(file));
        let s2 = sched.clone();
        let spawned = std::thread::Builder::new().name(format!("executor-{tenant}")).spawn(move || {
            let why = crate::grant::serve(&s2, &tenant, chan, &served);
            info!(tenant = %tenant, "executor's grant channel ended: {why}");
        });
        if let Err(e) = spawned {
            warn!("no thread for an executor's grant channel: {e}");
        }
    }
}
