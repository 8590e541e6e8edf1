//! Metering for billing: per tenant and device, what its work used, kept
//! across worker restarts and appended as usage records to a durable file
//! (JSON lines) that `GET /usage?since=` serves.
//!
//! The control plane samples every worker's counters once a second. A
//! worker's counters start again from zero when it restarts, so the meter
//! keeps its own totals, adding the difference between samples (or the new
//! worker's whole count after a restart). Every `interval` it appends one
//! record per tenant and device, plus one per device with its busy time,
//! and syncs the file. What a worker did after its last sample before it
//! died (at most one sample period) is lost, for its tenants and its busy
//! time alike.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{BufRead, Seek, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tracing::warn;

use super::Control;
use crate::ipc::DeviceStats;

/// How often worker counters are sampled.
pub const SAMPLE: Duration = Duration::from_secs(1);
/// Most records one `GET /usage` answers with.
pub const MAX_RECORDS: usize = 100_000;
/// The furthest the wall clock may go back and records still be stamped
/// with the latest time already written (seconds).
const MAX_STEP_BACK: f64 = 3600.0;

/// Usage of one tenant on one device.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Usage {
    pub device_seconds: f64,
    pub memory_byte_seconds: f64,
    pub spilled_byte_seconds: f64,
    pub kernels: u64,
    pub bytes_copied: u64,
    pub bytes_scrubbed: u64,
}

impl Usage {
    fn add(&mut self, o: &Usage) {
        self.device_seconds += o.device_seconds;
        self.memory_byte_seconds += o.memory_byte_seconds;
        self.spilled_byte_seconds += o.spilled_byte_seconds;
        self.kernels += o.kernels;
        self.bytes_copied += o.bytes_copied;
        self.bytes_scrubbed += o.bytes_scrubbed;
    }

    fn is_zero(&self) -> bool {
        *self == Usage::default()
    }
}

/// One line of the usage file: a tenant's usage or a device's busy time
/// over an interval, or the end of a tenant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(tag = "type", rename_all = "lowercase")]
#[schema(as = UsageRecord)]
pub enum Record {
    /// A tenant's usage on a device over `[start, end)` (UNIX seconds).
    Tenant {
        start: f64,
        end: f64,
        tenant: String,
        device: String,
        uuid: String,
        #[serde(flatten)]
        usage: Usage,
    },
    /// A device's busy lane time over `[start, end)`.
    Device { start: f64, end: f64, device: String, uuid: String, model: String, busy_seconds: f64, lanes: u32 },
    /// The tenant was deleted at `at` (UNIX seconds): its usage records
    /// come before this one (all but at most one sample's), and a tenant
    /// made later under the same name is counted from zero.
    Deleted { at: f64, tenant: String },
}

impl Record {
    pub fn end(&self) -> f64 {
        match self {
            Record::Tenant { end, .. } | Record::Device { end, .. } => *end,
            Record::Deleted { at, .. } => *at,
        }
    }

    fn tenant(&self) -> Option<&str> {
        match self {
            Record::Tenant { tenant, .. } | Record::Deleted { tenant, .. } => Some(tenant),
            Record::Device { .. } => None,
        }
    }
}

/// The meter's totals since the first start.
#[derive(Debug, Default)]
pub struct Totals {
    /// (tenant, device, usage).
    pub tenants: Vec<(String, String, Usage)>,
    /// (device, busy seconds).
    pub busy: Vec<(String, f64)>,
    /// Device name to its (uuid, model).
    pub labels: HashMap<String, (String, String)>,
}

/// A worker's counters at the last sample.
struct Seen {
    pid: u32,
    restarts: u64,
    busy_ns: u64,
    tenants: HashMap<String, Counted>,
    at: Instant,
}

/// A tenant's counters when it was last sampled. Its device time is the
/// worker's (the arbiter's clock, with executors); its kernels and bytes
/// are counted by whoever holds its state, which starts from zero when an
/// executor is replaced.
#[derive(Clone, Copy)]
struct Counted {
    device_ns: u64,
    /// The executor that counted `kernels`, `copied` and `scrubbed` (its
    /// pid; 0: the device's worker).
    executor: u32,
    kernels: u64,
    copied: u64,
    scrubbed: u64,
    at: Instant,
}

#[derive(Default)]
struct State {
    seen: HashMap<String, Seen>,
    /// Since the mediator's first start (recovered from the file).
    totals: BTreeMap<(String, String), Usage>,
    busy: BTreeMap<String, f64>,
    /// Not yet written to the file.
    pending: BTreeMap<(String, String), Usage>,
    pending_busy: BTreeMap<String, f64>,
    /// Records of deleted tenants, ready to be written before the rest:
    /// each one's last usage, then its end. Written apart from `pending`,
    /// where a new tenant of the same name starts afresh.
    ended: String,
    /// UUID, model and lanes per device, from the last sample.
    labels: HashMap<String, (String, String, u32)>,
    since: f64,
    /// The latest time stamped on a record (written or pending), so that
    /// the file stays in the order of [`Record::end`] even when the wall
    /// clock is stepped back: `GET /usage` searches it by that order.
    last: f64,
}

/// The meter's totals as of the end of the usage file's last batch, kept
/// beside it (`FILE.totals`): a start reads the records after them only,
/// not the whole history, and the totals outlive a rotated file.
#[derive(Serialize, Deserialize)]
struct Snapshot {
    /// The usage file they were taken against (its device and inode), and
    /// its length then.
    dev: u64,
    ino: u64,
    len: u64,
    last: f64,
    tenants: Vec<(String, String, Usage)>,
    busy: Vec<(String, f64)>,
}

fn snapshot_path(usage: &Path) -> PathBuf {
    let mut name = usage.file_name().unwrap_or_default().to_os_string();
    name.push(".totals");
    usage.with_file_name(name)
}

impl State {
    /// Takes the totals from the snapshot beside the usage file where it
    /// was taken against that file; returns the offset in the file where
    /// the records it does not cover start (0: the whole file).
    fn restore(&mut self, usage: &Path) -> u64 {
        use std::os::unix::fs::MetadataExt;
        let at = snapshot_path(usage);
        let snap = match std::fs::read(&at) {
            Ok(b) => match serde_json::from_slice::<Snapshot>(&b) {
                Ok(s) => s,
                Err(e) => {
                    warn!("usage totals {}: unreadable ({e}); the totals are read from the usage file", at.display());
                    return 0;
                }
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return 0,
            Err(e) => {
                warn!("usage totals {}: {e}; the totals are read from the usage file", at.display());
                return 0;
            }
        };
        let from = match std::fs::metadata(usage) {
            Ok(m) if (m.dev(), m.ino()) == (snap.dev, snap.ino) && m.len() >= snap.len => snap.len,
            // Rotated away after the last batch: the totals stand, and a
            // new file's records (in time order) come after them where its
            // first does.
            Ok(_) if first_end(usage).is_none_or(|e| e > snap.last) => 0,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
            _ => {
                warn!("usage totals {} were taken against another usage file, or a longer one; the totals are read from the usage file", at.display());
                return 0;
            }
        };
        self.totals = snap.tenants.into_iter().map(|(t, d, u)| ((t, d), u)).collect();
        self.busy = snap.busy.into_iter().collect();
        self.last = snap.last;
        from
    }

    /// Now, or the latest time already stamped if the clock went back by
    /// at most [`MAX_STEP_BACK`]. A clock further behind than that (the
    /// file was written by a clock far ahead, or edited) is taken as it
    /// is, with a warning, rather than holding every record to come at
    /// that time.
    fn stamp(&mut self) -> f64 {
        let now = unix_now();
        if self.last - now > MAX_STEP_BACK {
            warn!(
                behind_s = self.last - now,
                "the clock is behind the usage file's latest record by more than an hour: records are stamped with the clock's time, and queries by time may miss records around that point"
            );
            self.last = now;
        }
        let t = now.max(self.last);
        self.last = t;
        t
    }
}

pub struct Meter {
    path: PathBuf,
    interval: Duration,
    state: Mutex<State>,
    /// One sampler at a time, from reading the workers to applying what
    /// they said: samples are applied in the order they were taken.
    sampling: Mutex<()>,
}

/// One line of the usage file.
fn record_line(r: &Record) -> String {
    serde_json::to_string(r).unwrap_or_default() + "\n"
}

fn unix_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

#[derive(Debug, thiserror::Error)]
pub enum MeterError {
    #[error("usage file {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("usage file {path}: more than {MAX_RECORDS} records end at {end}, more than one answer holds; read them from the file")]
    IntervalTooLarge { path: String, end: f64 },
}

impl Meter {
    /// A meter writing to `path` every `interval`, its totals recovered
    /// from the records already there.
    pub fn open(path: &Path, interval: Duration) -> Result<Arc<Meter>, MeterError> {
        let io = |source| MeterError::Io { path: path.display().to_string(), source };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let mut st = State::default();
        let from = st.restore(path);
        let mut torn = false;
        match std::fs::File::open(path) {
            Ok(f) => {
                let mut f = std::io::BufReader::new(f);
                f.seek(std::io::SeekFrom::Start(from)).map_err(io)?;
                let mut line = Vec::new();
                let mut n = 0;
                loop {
                    line.clear();
                    if f.read_until(b'\n', &mut line).map_err(io)? == 0 {
                        break;
                    }
                    n += 1;
                    torn = line.last() != Some(&b'\n');
                    let r = match serde_json::from_slice::<Record>(&line) {
                        Ok(r) => r,
                        // A torn last line (a crash mid-write) is skipped.
                        Err(e) => {
                            warn!(line = n, from, "usage file {}: unreadable record skipped: {e}", path.display());
                            continue;
                        }
                    };
                    st.last = st.last.max(r.end());
                    match r {
                        Record::Tenant { tenant, device, usage, .. } => st.totals.entry((tenant, device)).or_default().add(&usage),
                        Record::Device { device, busy_seconds, .. } => *st.busy.entry(device).or_default() += busy_seconds,
                        Record::Deleted { tenant, .. } => st.totals.retain(|(t, _), _| *t != tenant),
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io(e)),
        }
        // A line torn by a crash is ended, so that the next record starts
        // a line of its own instead of joining it.
        if torn {
            std::fs::OpenOptions::new().append(true).open(path).and_then(|mut f| f.write_all(b"\n")).map_err(io)?;
        }
        // What was read is not read again at the next start, even if this
        // run writes nothing.
        if let Some(meta) = std::fs::metadata(path).ok().filter(|m| m.len() > from) {
            save_snapshot(path, &st, &meta);
        }
        st.since = st.stamp();
        Ok(Arc::new(Meter { path: path.to_path_buf(), interval: interval.max(SAMPLE), state: Mutex::new(st), sampling: Mutex::new(()) }))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Samples every worker every second and writes records every
    /// interval, until the process ends.
    pub fn run(self: Arc<Self>, control: Arc<Control>) {
        let mut next_write = Instant::now() + self.interval;
        loop {
            std::thread::sleep(SAMPLE);
            self.sample(&control);
            if Instant::now() >= next_write {
                next_write += self.interval;
                if let Err(e) = self.flush() {
                    warn!("{e}; the records are kept and written with the next ones");
                }
            }
        }
    }

    /// Takes one sample of every device; returns what each worker said
    /// (None: down or slow to answer), in the control plane's order.
    pub fn sample(&self, control: &Control) -> Vec<Option<DeviceStats>> {
        let _one = self.sampling.lock().unwrap_or_else(|e| e.into_inner());
        control
            .devices
            .iter()
            .map(|slot| {
                let who = || (slot.pid.load(Ordering::Acquire), slot.restarts.load(Ordering::Acquire));
                let before = who();
                let (stats, executors) = slot.sourced_stats()?;
                // A worker that restarted meanwhile: whose counters these
                // are is not known, so they are not used (the next sample is).
                if who() == before {
                    // Applied under the registry's lock, as a delete is
                    // (`Control::finish_delete`): a tenant deleted after
                    // this sample was taken is not live here, and one
                    // live here is not deleted until it is applied.
                    let registry = control.registry();
                    let live: HashSet<String> = registry.values().filter(|t| t.device == slot.spec.name).map(|t| t.name.clone()).collect();
                    self.add_sample(&slot.spec.name, before.0, before.1, &stats, &executors, &live);
                }
                Some(stats)
            })
            .collect()
    }

    /// A tenant is gone: its totals leave the meter (and `/metrics`) once
    /// the usage it had not yet written is, and the file records its end,
    /// so that neither a daemon restart nor a new tenant of the same name
    /// brings them back. Without this, every tenant ever made (a container
    /// orchestrator makes one per workload) would stay in memory and in
    /// every scrape for good.
    pub fn tenant_deleted(&self, name: &str) {
        let mut st = self.lock();
        let now = st.stamp();
        st.totals.retain(|(t, _), _| t != name);
        for seen in st.seen.values_mut() {
            seen.tenants.remove(name);
        }
        let start = st.since;
        let mine: Vec<(String, Usage)> = st.pending.iter().filter(|((t, _), u)| t == name && !u.is_zero()).map(|((_, d), u)| (d.clone(), u.clone())).collect();
        st.pending.retain(|(t, _), _| t != name);
        let mut lines = String::new();
        for (device, usage) in mine {
            let uuid = st.labels.get(&device).map(|l| l.0.clone()).unwrap_or_default();
            lines += &record_line(&Record::Tenant { start, end: now, tenant: name.to_string(), device, uuid, usage });
        }
        lines += &record_line(&Record::Deleted { at: now, tenant: name.to_string() });
        st.ended += &lines;
    }

    /// Keeps the totals of these tenants only: at start, the tenants the
    /// daemon still has (one deleted while it was down, or whose end was
    /// not yet written when it stopped, is dropped).
    pub fn retain_tenants(&self, live: &HashSet<String>) {
        self.lock().totals.retain(|(t, _), _| live.contains(t));
    }

    /// Adds what a device's counters show since its last sample.
    /// `executors` names, per tenant, the executor its kernel and byte
    /// counts came from (absent: the worker's own); `live` are the tenants
    /// placed on the device, whose last counts are kept while a sample
    /// misses them (an executor slow to answer, or being replaced), so
    /// that nothing they used is counted twice. A tenant no longer live
    /// (deleted after the sample was taken) is left out: its end is
    /// already recorded, and what it did in that last second is lost, as
    /// a dying worker's last second is.
    fn add_sample(&self, device: &str, pid: u32, restarts: u64, d: &DeviceStats, executors: &HashMap<String, u32>, live: &HashSet<String>) {
        let now = Instant::now();
        let mut st = self.lock();
        st.labels.insert(device.to_string(), (d.uuid.clone(), d.name.clone(), d.lanes));
        let prev = st.seen.remove(device);
        if prev.as_ref().is_some_and(|p| p.pid == pid && p.restarts == restarts && p.busy_ns > d.busy_ns) {
            // Taken before the last one applied (two samplers raced): it
            // adds nothing.
            if let Some(p) = prev {
                st.seen.insert(device.to_string(), p);
            }
            return;
        }
        // After a restart the new worker counts from zero.
        let prev = prev.filter(|p| p.pid == pid && p.restarts == restarts);
        let dt = prev.as_ref().map(|p| now.duration_since(p.at).as_secs_f64()).unwrap_or(0.0);
        let busy = d.busy_ns - prev.as_ref().map(|p| p.busy_ns).unwrap_or(0);
        *st.busy.entry(device.to_string()).or_default() += busy as f64 / 1e9;
        *st.pending_busy.entry(device.to_string()).or_default() += busy as f64 / 1e9;
        let mut seen = Seen { pid, restarts, busy_ns: d.busy_ns, tenants: HashMap::new(), at: now };
        for t in d.tenants.iter().filter(|t| live.contains(&t.name)) {
            let executor = executors.get(&t.name).copied().unwrap_or(0);
            let cur = Counted { device_ns: t.device_ns, executor, kernels: t.kernels, copied: t.bytes_copied, scrubbed: t.bytes_scrubbed, at: now };
            let last = prev.as_ref().and_then(|p| p.tenants.get(&t.name));
            // Each source's counts from its own last ones: a count that
            // went back started again from zero.
            let ns_was = last.map(|w| w.device_ns).filter(|&w| w <= cur.device_ns).unwrap_or(0);
            let (k_was, c_was, s_was) =
                last.filter(|w| w.executor == executor && w.kernels <= cur.kernels && w.copied <= cur.copied && w.scrubbed <= cur.scrubbed).map_or((0, 0, 0), |w| (w.kernels, w.copied, w.scrubbed));
            // Memory is held for the time since the tenant's own last
            // sample (the device's, for its first).
            let held = last.map_or(dt, |w| now.duration_since(w.at).as_secs_f64());
            let u = Usage {
                device_seconds: (cur.device_ns - ns_was) as f64 / 1e9,
                memory_byte_seconds: t.used as f64 * held,
                spilled_byte_seconds: t.spilled as f64 * held,
                kernels: cur.kernels - k_was,
                bytes_copied: cur.copied - c_was,
                bytes_scrubbed: cur.scrubbed - s_was,
            };
            seen.tenants.insert(t.name.clone(), cur);
            let key = (t.name.clone(), device.to_string());
            st.totals.entry(key.clone()).or_default().add(&u);
            st.pending.entry(key).or_default().add(&u);
        }
        // Tenants still on the device that this sample missed keep their
        // last counts; a deleted tenant's are dropped.
        if let Some(p) = prev {
            for (name, c) in p.tenants {
                if live.contains(&name) && !seen.tenants.contains_key(&name) {
                    seen.tenants.insert(name, c);
                }
            }
        }
        st.seen.insert(device.to_string(), seen);
    }

    /// Appends the records of the interval that ends now and syncs them.
    pub fn flush(&self) -> Result<(), MeterError> {
        let mut st = self.lock();
        let end = st.stamp();
        let start = st.since;
        // Deleted tenants' last records first: everything after a tenant's
        // end is a new tenant's of the same name.
        let mut lines = st.ended.clone();
        for ((tenant, device), usage) in &st.pending {
            if usage.is_zero() {
                continue;
            }
            let uuid = st.labels.get(device).map(|l| l.0.clone()).unwrap_or_default();
            lines += &record_line(&Record::Tenant { start, end, tenant: tenant.clone(), device: device.clone(), uuid, usage: usage.clone() });
        }
        for (device, busy) in &st.pending_busy {
            if *busy == 0.0 {
                continue;
            }
            let (uuid, model, lanes) = st.labels.get(device).cloned().unwrap_or_default();
            lines += &record_line(&Record::Device { start, end, device: device.clone(), uuid, model, busy_seconds: *busy, lanes });
        }
        if !lines.is_empty() {
            // Opened for each batch, so an operator's log rotation (rename)
            // takes effect at the next one.
            let io = |source| MeterError::Io { path: self.path.display().to_string(), source };
            let mut f = std::fs::OpenOptions::new().create(true).read(true).append(true).open(&self.path).map_err(io)?;
            let before = f.metadata().map_err(io)?.len();
            // After a torn line (a batch that could not be taken back) the
            // batch starts a line of its own.
            let mut last = [b'\n'];
            if before > 0 {
                std::os::unix::fs::FileExt::read_at(&f, &mut last, before - 1).map_err(io)?;
            }
            let batch = if last[0] == b'\n' { lines } else { format!("\n{lines}") };
            if let Err(e) = f.write_all(batch.as_bytes()).and_then(|()| f.sync_data()) {
                // What reached the file is taken back: the batch is kept
                // and written once, whole, with the next one.
                if let Err(t) = f.set_len(before) {
                    warn!("usage file {}: a failed write could not be taken back ({t}): its records may be written twice", self.path.display());
                }
                return Err(io(e));
            }
            // The file now holds what the totals count (they change under
            // this lock only).
            let meta = f.metadata().map_err(io)?;
            save_snapshot(&self.path, &st, &meta);
        }
        st.ended.clear();
        st.pending.clear();
        st.pending_busy.clear();
        st.since = end;
        Ok(())
    }

    /// What the meter has counted since the first start.
    pub fn totals(&self) -> Totals {
        let st = self.lock();
        Totals {
            tenants: st.totals.iter().map(|((t, d), u)| (t.clone(), d.clone(), u.clone())).collect(),
            busy: st.busy.iter().map(|(d, s)| (d.clone(), *s)).collect(),
            labels: st.labels.iter().map(|(d, (u, m, _))| (d.clone(), (u.clone(), m.clone()))).collect(),
        }
    }

    /// Records whose interval ends after `since` (UNIX seconds), of one
    /// tenant if given, oldest first: at most `limit`, cut where one
    /// interval's records end and the next one's start, so that asking
    /// again with `since` set to the last record's end misses nothing.
    /// (An interval with more than `limit` records of its own is answered
    /// whole; one of more than [`MAX_RECORDS`] is an error.) The file is in the order of
    /// [`Record::end`], so the first record is found by bisection: the
    /// time taken grows with the answer, not with the file.
    pub fn records(&self, since: f64, tenant: Option<&str>, limit: usize) -> Result<Vec<Record>, MeterError> {
        let io = |source| MeterError::Io { path: self.path.display().to_string(), source };
        match std::fs::File::open(&self.path) {
            Ok(f) => match records_in(f, since, tenant, limit).map_err(io)? {
                Ok(recs) => Ok(recs),
                Err(TooLarge(end)) => Err(MeterError::IntervalTooLarge { path: self.path.display().to_string(), end }),
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(io(e)),
        }
    }
}

/// Writes the totals beside the usage file, whole or not at all (a new file
/// renamed over the old one); a failure is a warning (the next start reads
/// the whole usage file).
fn save_snapshot(path: &Path, st: &State, usage: &std::fs::Metadata) {
    if let Err(e) = write_snapshot(path, st, usage) {
        warn!("usage totals {}: {e}; a start reads the whole usage file", snapshot_path(path).display());
    }
}

fn write_snapshot(path: &Path, st: &State, usage: &std::fs::Metadata) -> std::io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let snap = Snapshot {
        dev: usage.dev(),
        ino: usage.ino(),
        len: usage.len(),
        last: st.last,
        tenants: st.totals.iter().map(|((t, d), u)| (t.clone(), d.clone(), u.clone())).collect(),
        busy: st.busy.iter().map(|(d, b)| (d.clone(), *b)).collect(),
    };
    let at = snapshot_path(path);
    let mut tmp = at.clone().into_os_string();
    tmp.push(".new");
    let tmp = PathBuf::from(tmp);
    // Made afresh (never through a link left at its name).
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).open(&tmp)?;
    f.write_all(&serde_json::to_vec(&snap).map_err(std::io::Error::other)?)?;
    f.sync_data()?;
    std::fs::rename(&tmp, &at)
}

/// Below this many bytes between its bounds, the search reads on instead
/// of bisecting further.
const SCAN_BYTES: u64 = 64 << 10;

/// The first record that starts at or after byte `at` and parses, with
/// where its line starts; None at the end of the file.
fn record_from<R: BufRead + Seek>(r: &mut R, at: u64, line: &mut Vec<u8>) -> std::io::Result<Option<(u64, Record)>> {
    // Unless `at` starts the file, the line holding byte `at - 1` is
    // skipped: it started before `at`.
    let mut pos = at.saturating_sub(1);
    r.seek(std::io::SeekFrom::Start(pos))?;
    if at > 0 {
        line.clear();
        pos += r.read_until(b'\n', line)? as u64;
    }
    loop {
        line.clear();
        let n = r.read_until(b'\n', line)? as u64;
        if n == 0 {
            return Ok(None);
        }
        if let Ok(rec) = serde_json::from_slice::<Record>(line) {
            return Ok(Some((pos, rec)));
        }
        pos += n;
    }
}

/// The end of a usage file's first record; None where it has none (or
/// cannot be read).
fn first_end(usage: &Path) -> Option<f64> {
    let f = std::fs::File::open(usage).ok()?;
    let (_, r) = record_from(&mut std::io::BufReader::new(f), 0, &mut Vec::new()).ok()??;
    Some(r.end())
}

/// More records end at this time than one answer holds: paging by time
/// cannot pass them.
#[derive(Debug, PartialEq)]
struct TooLarge(f64);

/// [`Meter::records`] over a usage file's bytes.
fn records_in<R: std::io::Read + Seek>(r: R, since: f64, tenant: Option<&str>, limit: usize) -> std::io::Result<Result<Vec<Record>, TooLarge>> {
    let mut r = std::io::BufReader::with_capacity(8 << 10, r);
    let mut line = Vec::new();
    // Every record that starts before `lo` ends at or before `since`.
    let (mut lo, mut hi) = (0, r.seek(std::io::SeekFrom::End(0))?);
    while hi - lo > SCAN_BYTES {
        let mid = lo + (hi - lo) / 2;
        match record_from(&mut r, mid, &mut line)? {
            // (The file may have grown since its length was read.)
            Some((at, rec)) if rec.end() <= since => lo = at.max(mid).min(hi),
            _ => hi = mid,
        }
    }
    let mut out: Vec<Record> = Vec::new();
    // Set once `limit` is reached inside one interval that is the whole
    // answer: it goes on to that interval's end.
    let mut whole = false;
    // `lo` starts a line: from there the file is read in order.
    r.seek(std::io::SeekFrom::Start(lo))?;
    loop {
        line.clear();
        if r.read_until(b'\n', &mut line)? == 0 {
            break;
        }
        let Ok(rec) = serde_json::from_slice::<Record>(&line) else { continue };
        if rec.end() <= since || tenant.is_some_and(|t| rec.tenant() != Some(t)) {
            continue;
        }
        if out.len() >= limit {
            let e = out.last().map(Record::end);
            if e != Some(rec.end()) {
                break;
            }
            if whole && out.len() >= MAX_RECORDS {
                return Ok(Err(TooLarge(rec.end())));
            }
            // The limit falls inside an interval: the answer ends before
            // it, unless it is the only one.
            if !whole {
                match out.iter().rposition(|x| Some(x.end()) != e) {
                    Some(i) => {
                        out.truncate(i + 1);
                        break;
                    }
                    None => whole = true,
                }
            }
        }
        out.push(rec);
    }
    Ok(Ok(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ipc::TenantStats;

    fn stats(busy: u64, tenants: &[(&str, u64, u64)]) -> DeviceStats {
        DeviceStats {
            kind: "cpu".into(),
            name: "model".into(),
            uuid: "GPU-x".into(),
            busy_ns: busy,
            lanes: 2,
            tenants: tenants.iter().map(|(n, ns, used)| TenantStats { name: n.to_string(), device_ns: *ns, used: *used, kernels: 1, ..TenantStats::default() }).collect(),
            ..DeviceStats::default()
        }
    }

    /// A sample of a device's worker alone (no executors), every tenant in
    /// it placed there.
    fn add(m: &Meter, pid: u32, restarts: u64, d: &DeviceStats) {
        let live = d.tenants.iter().map(|t| t.name.clone()).collect();
        m.add_sample("cpu0", pid, restarts, d, &HashMap::new(), &live);
    }

    #[test]
    fn totals_survive_a_worker_restart_and_a_mediator_restart() {
        let dir = std::env::temp_dir().join(format!("vgpu-meter-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let path = dir.join("usage.jsonl");
        let m = Meter::open(&path, SAMPLE).unwrap();
        add(&m, 10, 0, &stats(3_000_000_000, &[("a", 1_000_000_000, 0), ("b", 2_000_000_000, 0)]));
        add(&m, 10, 0, &stats(5_000_000_000, &[("a", 2_000_000_000, 0), ("b", 3_000_000_000, 0)]));
        // The worker restarted: its counters start again from zero.
        add(&m, 11, 1, &stats(1_000_000_000, &[("a", 500_000_000, 0), ("b", 500_000_000, 0)]));
        m.flush().unwrap();
        let tot = m.totals();
        let t = tot.tenants;
        let secs = |name: &str| t.iter().find(|x| x.0 == name).unwrap().2.device_seconds;
        assert_eq!((secs("a"), secs("b"), tot.busy[0].1), (2.5, 3.5, 6.0));
        assert_eq!(t.iter().find(|x| x.0 == "a").unwrap().2.kernels, 2, "one kernel per worker's count");
        // A new mediator reads the totals back, and the records add up.
        let m2 = Meter::open(&path, SAMPLE).unwrap();
        assert_eq!(m2.totals().tenants, t);
        let recs = m2.records(0.0, None, 100).unwrap();
        let tenant_s: f64 = recs.iter().map(|r| if let Record::Tenant { usage, .. } = r { usage.device_seconds } else { 0.0 }).sum();
        let busy_s: f64 = recs.iter().map(|r| if let Record::Device { busy_seconds, .. } = r { *busy_seconds } else { 0.0 }).sum();
        assert_eq!((tenant_s, busy_s), (6.0, 6.0));
        assert_eq!(m2.records(0.0, Some("a"), 100).unwrap().len(), 1);
        assert!(m2.records(unix_now() + 10.0, None, 100).unwrap().is_empty());
        // A torn line is skipped, not fatal.
        std::fs::OpenOptions::new().append(true).open(&path).unwrap().write_all(b"{\"type\":\"ten").unwrap();
        assert_eq!(Meter::open(&path, SAMPLE).unwrap().totals().tenants, t);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A reader that counts the bytes read through it.
    struct Counting<R> {
        inner: R,
        read: std::rc::Rc<std::cell::Cell<u64>>,
    }

    impl<R: std::io::Read> std::io::Read for Counting<R> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let n = self.inner.read(buf)?;
            self.read.set(self.read.get() + n as u64);
            Ok(n)
        }
    }

    impl<R: Seek> Seek for Counting<R> {
        fn seek(&mut self, to: std::io::SeekFrom) -> std::io::Result<u64> {
            self.inner.seek(to)
        }
    }

    /// A usage file of `intervals` intervals of `per` tenant records each
    /// (interval `i` ends at second `1000 + i`), with an unreadable line
    /// now and then.
    fn usage_file(intervals: u32, per: u32) -> (Vec<u8>, Vec<Record>) {
        let (mut bytes, mut all) = (Vec::new(), Vec::new());
        for i in 0..intervals {
            if i % 97 == 0 {
                bytes.extend_from_slice(b"{\"type\":\"ten\n");
            }
            for t in 0..per {
                let r = Record::Tenant {
                    start: 999.0 + i as f64,
                    end: 1000.0 + i as f64,
                    tenant: format!("t{t}"),
                    device: "cpu0".into(),
                    uuid: "GPU-x".into(),
                    usage: Usage { kernels: (i * per + t) as u64, ..Usage::default() },
                };
                bytes.extend_from_slice(record_line(&r).as_bytes());
                all.push(r);
            }
        }
        (bytes, all)
    }

    #[test]
    fn a_usage_query_reads_what_it_answers_not_the_whole_file() {
        let (bytes, all) = usage_file(40_000, 3);
        assert!(bytes.len() > 15 << 20, "{}", bytes.len());
        for since in [0.0, 999.0, 1000.0, 1000.5, 5123.0, 20_000.0, 40_998.0, 40_999.0, 1e12] {
            let want: Vec<&Record> = all.iter().filter(|r| r.end() > since).take(30).collect();
            let read = std::rc::Rc::new(std::cell::Cell::new(0));
            let got = records_in(Counting { inner: std::io::Cursor::new(&bytes), read: read.clone() }, since, None, 30).unwrap().unwrap();
            assert_eq!(got.iter().collect::<Vec<_>>(), want, "since {since}");
            // A bisection's probes and one scan window, not 15 MiB.
            assert!(read.get() < 1 << 20, "since {since}: read {} bytes", read.get());
        }
        let t1: Vec<Record> = all.iter().filter(|r| r.end() > 30_000.0 && r.tenant() == Some("t1")).take(5).cloned().collect();
        assert_eq!(records_in(std::io::Cursor::new(&bytes), 30_000.0, Some("t1"), 5).unwrap().unwrap(), t1);
    }

    #[test]
    fn paging_by_the_last_records_end_misses_nothing() {
        let (bytes, all) = usage_file(50, 3);
        for limit in [1, 2, 3, 4, 5, 7, 100] {
            let (mut since, mut got) = (0.0, Vec::new());
            loop {
                let page = records_in(std::io::Cursor::new(&bytes), since, None, limit).unwrap().unwrap();
                let Some(last) = page.last() else { break };
                // Cut between intervals; one interval whole where it alone
                // is more than the limit.
                assert!(page.len() <= limit.max(3), "limit {limit}: {} records", page.len());
                since = last.end();
                got.extend(page);
            }
            assert_eq!(got, all, "limit {limit}");
        }
    }

    #[test]
    fn an_interval_larger_than_an_answer_is_an_error_not_a_loss() {
        let (bytes, _) = usage_file(1, (MAX_RECORDS + 1) as u32);
        assert_eq!(records_in(std::io::Cursor::new(&bytes), 0.0, None, 10).unwrap(), Err(TooLarge(1000.0)));
        // One that fits is answered whole.
        let (bytes, all) = usage_file(1, 5000);
        assert_eq!(records_in(std::io::Cursor::new(&bytes), 0.0, None, 10).unwrap(), Ok(all));
    }

    #[test]
    fn a_record_from_a_clock_far_ahead_does_not_hold_the_ones_after_it() {
        let dir = std::env::temp_dir().join(format!("vgpu-meter-f-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("u.jsonl");
        let far = unix_now() + 10.0 * MAX_STEP_BACK;
        std::fs::write(&path, record_line(&Record::Deleted { at: far, tenant: "x".into() })).unwrap();
        let m = Meter::open(&path, SAMPLE).unwrap();
        m.tenant_deleted("a");
        m.flush().unwrap();
        let ends: Vec<f64> = m.records(0.0, None, 100).unwrap().iter().map(Record::end).collect();
        assert!(ends.len() == 2 && ends[1] < far - MAX_STEP_BACK, "{ends:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn records_stay_in_time_order_when_the_clock_goes_back() {
        let dir = std::env::temp_dir().join(format!("vgpu-meter-c-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("u.jsonl");
        // Written by a clock 1000 s ahead of this one, and torn by a crash.
        let ahead = unix_now() + 1000.0;
        let r = Record::Device { start: ahead - 1.0, end: ahead, device: "cpu0".into(), uuid: "GPU-x".into(), model: "m".into(), busy_seconds: 1.0, lanes: 2 };
        std::fs::write(&path, record_line(&r) + "{\"type\":\"ten").unwrap();
        let m = Meter::open(&path, SAMPLE).unwrap();
        add(&m, 1, 0, &stats(1_000_000_000, &[("a", 1_000_000_000, 0), ("b", 1_000_000_000, 0)]));
        m.tenant_deleted("a");
        m.flush().unwrap();
        let recs = m.records(0.0, None, 100).unwrap();
        let ends: Vec<f64> = recs.iter().map(Record::end).collect();
        // The torn line stays unreadable; the records after it are whole.
        assert_eq!(recs.len(), 5, "{recs:?}");
        assert!(ends.windows(2).all(|w| w[0] <= w[1]) && ends[1] >= ahead, "{ends:?}");
        assert_eq!(Meter::open(&path, SAMPLE).unwrap().totals().busy, [("cpu0".to_string(), 2.0)]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_start_reads_the_records_after_its_snapshot_and_totals_outlive_a_rotated_file() {
        let dir = std::env::temp_dir().join(format!("vgpu-meter-s-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let path = dir.join("u.jsonl");
        let m = Meter::open(&path, SAMPLE).unwrap();
        add(&m, 1, 0, &stats(3_000_000_000, &[("a", 1_000_000_000, 0), ("b", 2_000_000_000, 0)]));
        m.flush().unwrap();
        add(&m, 1, 0, &stats(4_000_000_000, &[("a", 2_000_000_000, 0), ("b", 2_000_000_000, 0)]));
        m.flush().unwrap();
        let want = (m.totals().tenants, m.totals().busy);
        assert_eq!((want.0.len(), want.1[0].1), (2, 4.0));
        let now = |m: &Meter| (m.totals().tenants, m.totals().busy);
        // The records the snapshot covers are not read again: blanked in
        // place, the totals still come back whole.
        let len = std::fs::metadata(&path).unwrap().len() as usize;
        std::fs::write(&path, " ".repeat(len - 1) + "\n").unwrap();
        assert_eq!(now(&Meter::open(&path, SAMPLE).unwrap()), want);
        // Rotated away: the totals stand, and a new file adds to them.
        std::fs::rename(&path, dir.join("u.jsonl.1")).unwrap();
        let m = Meter::open(&path, SAMPLE).unwrap();
        assert_eq!(now(&m), want, "the totals went with the rotated file");
        add(&m, 2, 0, &stats(1_000_000_000, &[("a", 1_000_000_000, 0)]));
        m.flush().unwrap();
        let a = |m: &Meter| m.totals().tenants.iter().find(|t| t.0 == "a").map(|t| t.2.device_seconds);
        assert_eq!(a(&Meter::open(&path, SAMPLE).unwrap()), Some(3.0));
        // Rotated after the last batch, and a new file started by another
        // writer since: its records add too.
        std::fs::rename(&path, dir.join("u.jsonl.2")).unwrap();
        let later =
            Record::Tenant { start: unix_now() + 5.0, end: unix_now() + 6.0, tenant: "a".into(), device: "cpu0".into(), uuid: String::new(), usage: Usage { device_seconds: 1.0, ..Usage::default() } };
        std::fs::write(&path, record_line(&later)).unwrap();
        assert_eq!(a(&Meter::open(&path, SAMPLE).unwrap()), Some(4.0));
        // A file put in its place with older records, or a snapshot that
        // cannot be read: the totals are the file's own.
        let older = Record::Tenant { start: 1.0, end: 2.0, tenant: "a".into(), device: "cpu0".into(), uuid: String::new(), usage: Usage { device_seconds: 0.25, ..Usage::default() } };
        std::fs::write(&path, record_line(&older)).unwrap();
        assert_eq!(a(&Meter::open(&path, SAMPLE).unwrap()), Some(0.25));
        std::fs::write(dir.join("u.jsonl.totals"), "{").unwrap();
        std::fs::write(&path, record_line(&later)).unwrap();
        assert_eq!(a(&Meter::open(&path, SAMPLE).unwrap()), Some(1.0));
        // That start read the file: the next does not read it again.
        std::fs::write(&path, " ".repeat(record_line(&later).len() - 1) + "\n").unwrap();
        assert_eq!(a(&Meter::open(&path, SAMPLE).unwrap()), Some(1.0));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A usage file on a full file system: the batch that did not fit is
    /// written once and whole when there is room again, and the file adds
    /// up to the totals. Needs root (a small tmpfs is mounted).
    #[test]
    fn a_batch_that_does_not_fit_is_written_once_and_whole_later() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("SKIPPED: mounting a full tmpfs needs root");
            return;
        }
        let dir = std::env::temp_dir().join(format!("vgpu-meter-full-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let c = |s: &str| std::ffi::CString::new(s).unwrap();
        let (fs, target, opts) = (c("tmpfs"), c(dir.to_str().unwrap()), c("size=64k"));
        // SAFETY: the strings are NUL-terminated and outlive the call.
        if unsafe { libc::mount(fs.as_ptr(), target.as_ptr(), fs.as_ptr(), 0, opts.as_ptr().cast()) } != 0 {
            eprintln!("SKIPPED: cannot mount a tmpfs here: {}", std::io::Error::last_os_error());
            return;
        }
        struct Unmount(std::ffi::CString, PathBuf);
        impl Drop for Unmount {
            fn drop(&mut self) {
                // SAFETY: the path is NUL-terminated; a lazy unmount of our own mount.
                unsafe { libc::umount2(self.0.as_ptr(), libc::MNT_DETACH) };
                let _ = std::fs::remove_dir(&self.1);
            }
        }
        let _unmount = Unmount(target.clone(), dir.clone());
        let path = dir.join("u.jsonl");
        let m = Meter::open(&path, SAMPLE).unwrap();
        let names: Vec<String> = (0..60).map(|i| format!("tenant-with-a-long-name-{i:03}")).collect();
        let sample = |busy: u64| {
            let ts: Vec<(&str, u64, u64)> = names.iter().map(|n| (n.as_str(), busy, 0)).collect();
            stats(busy * 60, &ts)
        };
        add(&m, 1, 0, &sample(1_000_000_000));
        m.flush().unwrap();
        // Fill the file system, then a batch of 60 records (over 10 KiB)
        // finds room for part of itself.
        let filler = dir.join("filler");
        let mut f = std::fs::File::create(&filler).unwrap();
        while f.write_all(&[0u8; 512]).is_ok() {}
        drop(f);
        add(&m, 1, 0, &sample(2_000_000_000));
        assert!(m.flush().is_err(), "the batch fitted");
        std::fs::remove_file(&filler).unwrap();
        add(&m, 1, 0, &sample(3_000_000_000));
        m.flush().unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.lines().all(|l| serde_json::from_str::<Record>(l).is_ok()), "{text}");
        let in_file: f64 = m.records(0.0, None, 1000).unwrap().iter().map(|r| if let Record::Tenant { usage, .. } = r { usage.device_seconds } else { 0.0 }).sum();
        let counted: f64 = m.totals().tenants.iter().map(|t| t.2.device_seconds).sum();
        assert_eq!((in_file, counted), (180.0, 180.0));
    }

    #[test]
    fn memory_is_billed_by_the_byte_second() {
        let dir = std::env::temp_dir().join(format!("vgpu-meter-m-{}", std::process::id()));
        let m = Meter::open(&dir.join("u.jsonl"), SAMPLE).unwrap();
        add(&m, 1, 0, &stats(0, &[("a", 0, 1 << 20)]));
        std::thread::sleep(Duration::from_millis(200));
        add(&m, 1, 0, &stats(0, &[("a", 0, 1 << 20)]));
        let mbs = m.totals().tenants[0].2.memory_byte_seconds;
        assert!(mbs >= 0.2 * (1 << 20) as f64 && mbs < 2.0 * (1 << 20) as f64, "{mbs}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_replaced_or_silent_executor_is_not_billed_twice() {
        let dir = std::env::temp_dir().join(format!("vgpu-meter-e-{}", std::process::id()));
        let m = Meter::open(&dir.join("u.jsonl"), SAMPLE).unwrap();
        let live: HashSet<String> = ["a".to_string()].into();
        let with = |ns: u64, kernels: u64| {
            let mut d = stats(ns, &[("a", ns, 0)]);
            d.tenants[0].kernels = kernels;
            d
        };
        let by = |pid: u32| HashMap::from([("a".to_string(), pid)]);
        // The arbiter's clock keeps counting; executor 100 counts kernels.
        m.add_sample("cpu0", 1, 0, &with(2_000_000_000, 10), &by(100), &live);
        // A sample that missed the tenant (its executor slow to answer).
        m.add_sample("cpu0", 1, 0, &stats(3_000_000_000, &[]), &HashMap::new(), &live);
        m.add_sample("cpu0", 1, 0, &with(4_000_000_000, 12), &by(100), &live);
        // Its executor was replaced: the new one counts kernels from zero,
        // the arbiter's device time goes on.
        m.add_sample("cpu0", 1, 0, &with(5_000_000_000, 3), &by(200), &live);
        // A new executor that already counted more than the old one did.
        m.add_sample("cpu0", 1, 0, &with(6_000_000_000, 20), &by(300), &live);
        let t = &m.totals().tenants[0].2;
        assert_eq!((t.device_seconds, t.kernels), (6.0, 12 + 3 + 20));
        // A tenant deleted from the device has its counts dropped: made
        // again under its name, it is billed from its new counts.
        m.add_sample("cpu0", 1, 0, &stats(6_000_000_000, &[]), &HashMap::new(), &HashSet::new());
        let mut again = stats(7_000_000_000, &[("a", 1_000_000_000, 0)]);
        again.tenants[0].kernels = 1;
        m.add_sample("cpu0", 1, 0, &again, &by(400), &live);
        assert_eq!(m.totals().tenants[0].2.device_seconds, 7.0);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_deleted_tenant_leaves_the_totals_and_stays_gone_after_a_restart() {
        let dir = std::env::temp_dir().join(format!("vgpu-meter-d-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let path = dir.join("u.jsonl");
        let m = Meter::open(&path, SAMPLE).unwrap();
        let names = |m: &Meter| m.totals().tenants.iter().map(|t| t.0.clone()).collect::<Vec<_>>();
        add(&m, 1, 0, &stats(3_000_000_000, &[("a", 1_000_000_000, 0), ("b", 2_000_000_000, 0)]));
        m.flush().unwrap();
        // "a" used a second more, then was deleted before the next write.
        add(&m, 1, 0, &stats(4_000_000_000, &[("a", 2_000_000_000, 0), ("b", 2_000_000_000, 0)]));
        m.tenant_deleted("a");
        assert_eq!(names(&m), ["b"], "a deleted tenant stays in /metrics");
        // A sample taken before the delete and applied after it adds
        // nothing: the tenant's end is already recorded.
        let live: HashSet<String> = ["b".to_string()].into();
        m.add_sample("cpu0", 1, 0, &stats(5_000_000_000, &[("a", 3_000_000_000, 0), ("b", 2_000_000_000, 0)]), &HashMap::new(), &live);
        assert_eq!(names(&m), ["b"]);
        // A new "a", in the same interval, is counted from zero and apart.
        add(&m, 1, 0, &stats(6_000_000_000, &[("a", 500_000_000, 0), ("b", 2_000_000_000, 0)]));
        m.flush().unwrap();
        let a = |m: &Meter| m.totals().tenants.iter().find(|t| t.0 == "a").map(|t| t.2.device_seconds);
        assert_eq!(a(&m), Some(0.5));
        // In the file: the old "a"'s seconds, its end, then the new one's.
        let recs = m.records(0.0, Some("a"), 100).unwrap();
        let secs: Vec<f64> = recs.iter().map(|r| if let Record::Tenant { usage, .. } = r { usage.device_seconds } else { -1.0 }).collect();
        assert_eq!(secs, [1.0, 1.0, -1.0, 0.5], "{recs:?}");
        assert!(matches!(&recs[2], Record::Deleted { tenant, .. } if tenant == "a"), "{recs:?}");
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.lines().any(|l| l.starts_with("{\"type\":\"deleted\"") && l.contains("\"tenant\":\"a\"")), "{text}");
        // A restart does not bring the old one's totals back.
        let m2 = Meter::open(&path, SAMPLE).unwrap();
        assert_eq!(a(&m2), Some(0.5), "the deleted tenant's usage came back after a restart");
        // At start, tenants the daemon no longer has are dropped.
        m2.retain_tenants(&live);
        assert_eq!(names(&m2), ["b"]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
