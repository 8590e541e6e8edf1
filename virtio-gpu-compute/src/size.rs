//! Byte sizes as operators write them (shared by the mediator, the VMM and
//! the CLI): plain bytes, or a KiB/MiB/GiB/TiB
//! suffix (also K/M/G/T). In JSON and TOML a size is a number or a string.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Size(pub u64);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid size '{0}': use bytes or a KiB, MiB, GiB or TiB suffix (e.g. 256MiB)")]
pub struct SizeError(pub String);

impl std::str::FromStr for Size {
    type Err = SizeError;
    fn from_str(s: &str) -> Result<Size, SizeError> {
        let t = s.trim();
        let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let n: u64 = num.parse().map_err(|_| SizeError(s.to_string()))?;
        let shift = match unit.trim() {
            "" | "B" => 0,
            "K" | "KiB" | "k" => 10,
            "M" | "MiB" => 20,
            "G" | "GiB" => 30,
            "T" | "TiB" => 40,
            _ => return Err(SizeError(s.to_string())),
        };
        n.checked_mul(1u64 << shift).map(Size).ok_or_else(|| SizeError(s.to_string()))
    }
}

impl fmt::Display for Size {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (shift, unit) in [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")] {
            if self.0 >= 1 << shift && self.0.is_multiple_of(1 << shift) {
                return write!(f, "{}{unit}", self.0 >> shift);
            }
        }
        write!(f, "{}", self.0)
    }
}

impl Serialize for Size {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(self.0)
    }
}

/// A size as configs write it: a bare number or a string with a unit.
#[derive(Deserialize)]
#[serde(untagged)]
pub enum NumberOrText {
    Number(u64),
    Text(String),
}

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Size, D::Error> {
        match NumberOrText::deserialize(d)? {
            NumberOrText::Number(n) => Ok(Size(n)),
            NumberOrText::Text(s) => s.parse().map_err(serde::de::Error::custom),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_bytes_and_binary_suffixes() {
        assert_eq!("4096".parse::<Size>().unwrap(), Size(4096));
        assert_eq!("256MiB".parse::<Size>().unwrap(), Size(256 << 20));
        assert_eq!("2G".parse::<Size>().unwrap(), Size(2 << 30));
        assert_eq!("1 KiB".parse::<Size>().unwrap(), Size(1024));
        assert!("12XB".parse::<Size>().is_err());
        assert!("-1".parse::<Size>().is_err());
        assert!("99999999999TiB".parse::<Size>().is_err());
        assert_eq!(Size(512 << 20).to_string(), "512MiB");
    }
}
