//! Firecracker-style rate limits shared by the virtio devices (virtio-blk,
//! virtio-net): a token bucket on bytes and one on operations (requests,
//! frames), each optional. A bucket of `size` tokens refills continuously,
//! completely in `refill`. An operation bigger than the bucket goes once
//! the bucket is full and leaves it in debt by the rest (Firecracker's
//! over-consumption), so later operations wait until that is paid back:
//! whatever sizes a guest picks, it moves at most `size` per `refill` in
//! the long run. An operation is admitted by both buckets or by neither,
//! and a refusal says how long until there would be enough, so a device
//! thread waits in epoll for that long instead of spinning.

use std::time::{Duration, Instant};

/// A token bucket: `size` tokens, refilled completely every `refill`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bucket {
    pub size: u64,
    pub refill: Duration,
}

/// What the rate limiter allows: bytes and operations, each optional.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RateLimit {
    pub bandwidth: Option<Bucket>,
    pub ops: Option<Bucket>,
}

/// One bucket's state.
struct Tokens {
    b: Bucket,
    left: f64,
    at: Instant,
}

impl Tokens {
    fn new(b: Bucket, now: Instant) -> Tokens {
        Tokens { b, left: b.size as f64, at: now }
    }

    /// Tokens per nanosecond (a zero refill time counts as 1 ns).
    fn rate(&self) -> f64 {
        self.b.size as f64 / self.b.refill.as_nanos().max(1) as f64
    }

    fn refill(&mut self, now: Instant) {
        let dt = now.saturating_duration_since(self.at).as_nanos() as f64;
        self.left = (self.left + dt * self.rate()).min(self.b.size as f64);
        self.at = now;
    }

    /// After a refill: how long until `n` tokens (at most the bucket's
    /// size) are there, or `None` when they are there now.
    fn shortfall(&mut self, n: u64, now: Instant) -> Option<Duration> {
        self.refill(now);
        let n = n.min(self.b.size) as f64;
        if self.left >= n {
            return None;
        }
        let rate = self.rate();
        if rate <= 0.0 {
            // An empty bucket (size 0) never refills: treat as unlimited.
            return None;
        }
        Some(Duration::from_nanos(((n - self.left) / rate).ceil() as u64 + 1))
    }

    /// Takes `n` tokens; more than the bucket holds leaves it in debt.
    fn take(&mut self, n: u64) {
        self.left -= n as f64;
    }
}

/// Both buckets of one queue or device.
pub struct Limiter {
    bytes: Option<Tokens>,
    ops: Option<Tokens>,
}

impl Limiter {
    pub fn new(r: RateLimit, now: Instant) -> Limiter {
        Limiter { bytes: r.bandwidth.map(|b| Tokens::new(b, now)), ops: r.ops.map(|b| Tokens::new(b, now)) }
    }

    /// Takes one operation of `bytes` from both buckets, or from neither
    /// and says how long to wait.
    pub fn admit(&mut self, bytes: u64, now: Instant) -> Result<(), Duration> {
        let ops = self.ops.as_mut().and_then(|o| o.shortfall(1, now));
        let by = self.bytes.as_mut().and_then(|b| b.shortfall(bytes, now));
        if let Some(wait) = ops.max(by) {
            return Err(wait);
        }
        if let Some(o) = &mut self.ops {
            o.take(1);
        }
        if let Some(b) = &mut self.bytes {
            b.take(bytes);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_admits_its_size_then_makes_requests_wait_for_the_refill() {
        let t0 = Instant::now();
        let mut l = Limiter::new(RateLimit { bandwidth: Some(Bucket { size: 1 << 20, refill: Duration::from_secs(1) }), ops: Some(Bucket { size: 4, refill: Duration::from_secs(1) }) }, t0);
        assert!(l.admit(512 << 10, t0).is_ok());
        assert!(l.admit(512 << 10, t0).is_ok());
        // The bytes are spent: the next request waits about a quarter second for 256 KiB.
        let w = l.admit(256 << 10, t0).unwrap_err();
        assert!(w > Duration::from_millis(240) && w < Duration::from_millis(260), "{w:?}");
        let t1 = t0 + Duration::from_millis(260);
        assert!(l.admit(256 << 10, t1).is_ok());
        // Requests: 4 per second. Two went at t0 and one now; 1.04 came
        // back meanwhile, so two more fit and a third waits.
        assert!(l.admit(0, t1).is_ok());
        assert!(l.admit(0, t1).is_ok());
        let w = l.admit(0, t1).unwrap_err();
        assert!(w > Duration::from_millis(230) && w < Duration::from_millis(250), "{w:?}");
        // A request bigger than the bucket goes when the bucket is full and
        // leaves a debt: 40 KiB through a 4 KiB/100 ms bucket makes the next
        // request wait for the other 36 KiB, about 0.9 s.
        let mut big = Limiter::new(RateLimit { bandwidth: Some(Bucket { size: 4096, refill: Duration::from_millis(100) }), ops: None }, t0);
        assert!(big.admit(40 << 10, t0).is_ok());
        let w = big.admit(1, t0).unwrap_err();
        assert!(w > Duration::from_millis(895) && w < Duration::from_millis(905), "{w:?}");
        assert!(big.admit(1, t0 + Duration::from_millis(800)).is_err());
        assert!(big.admit(1, t0 + Duration::from_millis(901)).is_ok());
    }

    #[test]
    fn big_operations_cannot_beat_the_long_run_rate() {
        // 16 MiB requests through a 100 KiB per 100 ms bucket: over 10 s of
        // simulated time, at most about 10 MB go (plus one bucket).
        let t0 = Instant::now();
        let mut l = Limiter::new(RateLimit { bandwidth: Some(Bucket { size: 100 << 10, refill: Duration::from_millis(100) }), ops: None }, t0);
        let (mut now, mut moved) = (t0, 0u64);
        while now < t0 + Duration::from_secs(10) {
            match l.admit(16 << 20, now) {
                Ok(()) => moved += 16 << 20,
                Err(w) => now += w,
            }
        }
        assert!(moved <= (100 << 10) * 100 + (16 << 20), "{moved} bytes in 10 s");
    }

    #[test]
    fn a_refused_operation_takes_no_tokens_from_either_bucket() {
        let t0 = Instant::now();
        let mut l = Limiter::new(RateLimit { bandwidth: Some(Bucket { size: 1000, refill: Duration::from_secs(1) }), ops: Some(Bucket { size: 2, refill: Duration::from_secs(1) }) }, t0);
        assert!(l.admit(900, t0).is_ok());
        // Bytes short: refused, and the op bucket keeps its token.
        assert!(l.admit(500, t0).is_err());
        assert!(l.admit(100, t0).is_ok());
        assert!(l.admit(0, t0).is_err(), "both ops are spent");
        // No limits: everything goes.
        let mut none = Limiter::new(RateLimit::default(), t0);
        assert!((0..1000).all(|_| none.admit(1 << 30, t0).is_ok()));
    }
}
