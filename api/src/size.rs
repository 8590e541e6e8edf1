//! Byte sizes as operators write them, with one grammar everywhere (the
//! mediator's API and config, the VMM, the CLI): bytes, or a number with a
//! unit. Binary units: KiB, MiB, GiB, TiB (also Ki/Mi/Gi/Ti and K/M/G/T);
//! decimal units: KB, MB, GB, TB. The number may have a fraction when the
//! result is whole bytes ("1.5GiB"). In JSON and TOML a size is a whole
//! number of bytes or such a string. Printed as the largest binary unit
//! that divides it ("512MiB"), else in bytes.

use std::fmt;

use serde::de::Visitor;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Size(pub u64);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid size '{input}': {why}")]
pub struct SizeError {
    pub input: String,
    pub why: &'static str,
}

const GRAMMAR: &str = "use bytes, or a number with a unit: KiB, MiB, GiB, TiB (binary) or KB, MB, GB, TB (decimal), such as 256MiB or 1.5GiB";

fn unit(u: &str) -> Option<u64> {
    Some(match u {
        "" | "B" => 1,
        "K" | "k" | "Ki" | "KiB" => 1 << 10,
        "M" | "Mi" | "MiB" => 1 << 20,
        "G" | "Gi" | "GiB" => 1 << 30,
        "T" | "Ti" | "TiB" => 1 << 40,
        "KB" | "kB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        _ => return None,
    })
}

impl std::str::FromStr for Size {
    type Err = SizeError;
    fn from_str(s: &str) -> Result<Size, SizeError> {
        let bad = |why| SizeError { input: s.to_string(), why };
        let t = s.trim();
        let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
        let (num, u) = t.split_at(split);
        let mult = unit(u.trim()).ok_or(bad(GRAMMAR))?;
        let (int, frac) = num.split_once('.').unwrap_or((num, ""));
        let digits = |d: &str| d.bytes().all(|b| b.is_ascii_digit());
        if (int.is_empty() && frac.is_empty()) || !digits(int) || !digits(frac) || frac.len() > 12 {
            return Err(bad(GRAMMAR));
        }
        let whole = if int.is_empty() { 0 } else { int.parse::<u64>().map_err(|_| bad("too large"))? };
        let whole = whole.checked_mul(mult).ok_or(bad("too large"))?;
        if frac.is_empty() {
            return Ok(Size(whole));
        }
        // The fraction in exact integer arithmetic: frac / 10^len of a unit.
        let scale = 10u128.pow(frac.len() as u32);
        let part = frac.parse::<u128>().map_err(|_| bad(GRAMMAR))? * mult as u128;
        if !part.is_multiple_of(scale) {
            return Err(bad("not a whole number of bytes"));
        }
        u64::try_from(part / scale).ok().and_then(|p| whole.checked_add(p)).map(Size).ok_or(bad("too large"))
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

/// Reads a value written as a whole number or a string, with errors in a
/// user's terms (`expecting` names what was wanted).
pub fn number_or_text<'de, D, T>(d: D, expecting: &'static str, number: impl FnOnce(u64) -> Result<T, String>, text: impl FnOnce(&str) -> Result<T, String>) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
{
    struct V<N, X> {
        expecting: &'static str,
        number: N,
        text: X,
    }
    impl<'de, T, N: FnOnce(u64) -> Result<T, String>, X: FnOnce(&str) -> Result<T, String>> Visitor<'de> for V<N, X> {
        type Value = T;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(self.expecting)
        }
        fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<T, E> {
            (self.number)(n).map_err(E::custom)
        }
        fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<T, E> {
            match u64::try_from(n) {
                Ok(n) => self.visit_u64(n),
                Err(_) => Err(E::custom(format!("{n} is negative; {}", self.expecting))),
            }
        }
        fn visit_f64<E: serde::de::Error>(self, n: f64) -> Result<T, E> {
            Err(E::custom(format!("{n} is not a whole number; write {} (a fraction goes in a string with its unit, such as \"1.5GiB\")", self.expecting)))
        }
        fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<T, E> {
            (self.text)(s).map_err(E::custom)
        }
    }
    d.deserialize_any(V { expecting, number, text })
}

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Size, D::Error> {
        number_or_text(d, "a size: bytes, or a string such as \"256MiB\"", |n| Ok(Size(n)), |s| s.parse().map_err(|e: SizeError| e.to_string()))
    }
}

/// Its OpenAPI schema: a whole number of bytes, or a string in the
/// grammar above.
impl utoipa::PartialSchema for Size {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        number_or_text_schema(0, "256MiB", "Bytes, as a whole number or a string with a unit (KiB, MiB, GiB, TiB, Ki..., K...; KB, MB, GB, TB), such as \"1.5GiB\"")
    }
}

/// The schema of a value written as a whole number (at least `min`) or as
/// text such as `example` ([`number_or_text`]).
pub fn number_or_text_schema(min: u64, example: &str, description: &str) -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
    use utoipa::openapi::schema::{ObjectBuilder, OneOfBuilder, Type};
    OneOfBuilder::new()
        .item(ObjectBuilder::new().schema_type(Type::Integer).minimum(Some(min as f64)))
        .item(ObjectBuilder::new().schema_type(Type::String).examples([example]))
        .description(Some(description))
        .into()
}

impl utoipa::ToSchema for Size {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_grammar_for_every_size() {
        let ok = [
            ("4096", 4096),
            ("4096B", 4096),
            ("256MiB", 256 << 20),
            ("256Mi", 256 << 20),
            ("256M", 256 << 20),
            ("2G", 2 << 30),
            ("1 KiB", 1024),
            ("64k", 64 << 10),
            ("512MB", 512_000_000),
            ("1GB", 1_000_000_000),
            ("2TB", 2_000_000_000_000),
            ("1.5GiB", 3 << 29),
            ("0.5KiB", 512),
            ("2.25MB", 2_250_000),
            (" 1TiB ", 1 << 40),
        ];
        for (text, bytes) in ok {
            assert_eq!(text.parse::<Size>(), Ok(Size(bytes)), "{text}");
        }
        for (text, why) in [
            ("12XB", "use bytes"),
            ("-1", "use bytes"),
            ("", "use bytes"),
            (".", "use bytes"),
            ("1.2.3MiB", "use bytes"),
            ("0.1KiB", "whole number of bytes"),
            ("1.5", "whole number of bytes"),
            ("99999999999TiB", "too large"),
            ("1e3", "use bytes"),
        ] {
            let e = text.parse::<Size>().expect_err(text);
            assert!(e.to_string().contains(why) && e.to_string().contains(&format!("'{text}'")), "{text}: {e}");
        }
        assert_eq!(Size(512 << 20).to_string(), "512MiB");
        assert_eq!(Size(3 << 29).to_string(), "1536MiB");
        assert_eq!(Size(1000).to_string(), "1000");
        // Printed sizes read back as the same size.
        for b in [0u64, 1, 1000, 4096, 3 << 29, 1 << 40, 12345678] {
            assert_eq!(Size(b).to_string().parse::<Size>(), Ok(Size(b)));
        }
    }

    #[test]
    fn json_takes_numbers_and_strings_and_says_what_it_wanted() {
        assert_eq!(serde_json::from_str::<Size>("1048576").unwrap(), Size(1 << 20));
        assert_eq!(serde_json::from_str::<Size>("\"1.5GiB\"").unwrap(), Size(3 << 29));
        for (text, want) in [("true", "a size: bytes"), ("-5", "negative"), ("1.5", "not a whole number"), ("\"lots\"", "invalid size 'lots'")] {
            let e = serde_json::from_str::<Size>(text).expect_err(text).to_string();
            assert!(e.contains(want) && !e.contains("untagged"), "{text}: {e}");
        }
    }
}
