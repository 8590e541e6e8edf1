//! Kubernetes resource quantities (`16Gi`, `512Mi`, `1.5G`, `1e9`), as the
//! DRA driver reads and writes amounts of memory: parsed to whole bytes,
//! written in the API's canonical form for a whole number of bytes.

/// Most bytes a quantity may name here (an exabyte; no device has more).
pub const MAX: u64 = 1 << 60;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a quantity of bytes (a whole number with an optional suffix Ki, Mi, Gi, Ti, Pi, k, M, G, T or P, such as 16Gi)")]
pub struct QuantityError(pub String);

/// Parses `s` to bytes, rounding a fraction of a byte up (as the API does
/// for its integer view of a quantity).
pub fn parse(s: &str) -> Result<u64, QuantityError> {
    let bad = || QuantityError(s.to_string());
    let t = s.trim();
    if t.is_empty() || t.len() > 64 {
        return Err(bad());
    }
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+')).unwrap_or(t.len());
    let (num, suffix) = t.split_at(split);
    let (mult, exp10): (u128, i32) = match suffix {
        "" => (1, 0),
        "Ki" => (1 << 10, 0),
        "Mi" => (1 << 20, 0),
        "Gi" => (1 << 30, 0),
        "Ti" => (1 << 40, 0),
        "Pi" => (1 << 50, 0),
        "k" => (1, 3),
        "M" => (1, 6),
        "G" => (1, 9),
        "T" => (1, 12),
        "P" => (1, 15),
        e if e.starts_with(['e', 'E']) => (1, e[1..].parse::<i32>().ok().filter(|x| (0..=18).contains(x)).ok_or_else(bad)?),
        _ => return Err(bad()),
    };
    let num = num.strip_prefix('+').unwrap_or(num);
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    if (int.is_empty() && frac.is_empty()) || !int.bytes().all(|b| b.is_ascii_digit()) || !frac.bytes().all(|b| b.is_ascii_digit()) || int.len() > 19 || frac.len() > 18 {
        return Err(bad());
    }
    // value = (int.frac) * mult * 10^exp10, computed exactly in u128.
    let digits: u128 = format!("{int}{frac}").trim_start_matches('0').parse::<u128>().unwrap_or(0);
    let scale = exp10 - frac.len() as i32;
    let mut v = digits.checked_mul(mult).ok_or_else(bad)?;
    if scale >= 0 {
        v = v.checked_mul(10u128.checked_pow(scale as u32).ok_or_else(bad)?).ok_or_else(bad)?;
    } else {
        let d = 10u128.pow((-scale) as u32);
        v = v.div_ceil(d);
    }
    u64::try_from(v).ok().filter(|&b| b <= MAX).ok_or_else(bad)
}

/// `bytes` in the API's canonical form: the largest binary suffix that
/// divides it, else the plain number.
pub fn format(bytes: u64) -> String {
    for (suffix, shift) in [("Pi", 50), ("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10)] {
        if bytes != 0 && bytes.is_multiple_of(1u64 << shift) {
            return format!("{}{suffix}", bytes >> shift);
        }
    }
    bytes.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_parse_to_bytes_and_format_canonically() {
        for (s, b) in
            [("16Gi", 16u64 << 30), ("512Mi", 512 << 20), ("1.5Gi", 3 << 29), ("1G", 1_000_000_000), ("2k", 2000), ("1e9", 1_000_000_000), ("4096", 4096), ("0.5", 1), ("+1Ki", 1024), (".5Ki", 512)]
        {
            assert_eq!(parse(s), Ok(b), "{s}");
        }
        for s in ["", "Gi", "16GB", "-1Gi", "1.2.3", "16 Gi x", "99999999999999999999Pi", "2Ei", "1e30", "1m"] {
            assert!(parse(s).is_err(), "{s:?} parsed");
        }
        assert_eq!(format(16 << 30), "16Gi");
        assert_eq!(format(3 << 29), "1536Mi");
        assert_eq!(format(1000), "1000");
        assert_eq!(format(0), "0");
        for b in [0, 1, 1023, 1 << 20, 12345 << 10, 1 << 50] {
            assert_eq!(parse(&format(b)), Ok(b));
        }
    }
}
