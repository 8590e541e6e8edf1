//! PTX tokenizer. Comments are dropped; every token keeps its line for
//! error messages.
//!
//! Tokens borrow their text from the source, and the token vector is sized
//! by a counting pass before it is allocated, so a module's transient parse
//! memory is known (and can be charged to its tenant) before it is taken.

use super::PtxError;

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Tok<'a> {
    /// Identifiers, opcodes with their dotted modifiers, directives,
    /// registers (`%r1`, `%tid.x`) and labels.
    Word(&'a str),
    /// Integer literal (decimal, hex, octal or binary), sign applied later.
    Int(u64),
    /// Float literal: `0f...` (f32 bits), `0d...` (f64 bits) or decimal.
    F32(u32),
    F64(u64),
    Punct(char),
}

#[derive(Debug, Clone, Copy)]
pub struct Token<'a> {
    pub tok: Tok<'a>,
    pub line: u32,
}

/// Host bytes one token occupies while a module is parsed.
pub const TOKEN_BYTES: u64 = std::mem::size_of::<Token<'static>>() as u64;

fn word_start(c: u8) -> bool {
    c.is_ascii_alphabetic() || matches!(c, b'_' | b'.' | b'%' | b'$')
}

fn word_char(c: u8) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, b'_' | b'.' | b'%' | b'$')
}

/// Walks `src` once, handing each token to `emit`.
fn scan<'a>(src: &'a str, mut emit: impl FnMut(Token<'a>)) -> Result<(), PtxError> {
    let b = src.as_bytes();
    let mut i = 0;
    let mut line = 1u32;
    // Slices below start and end on ASCII bytes, so they are char boundaries.
    let text = |s: usize, e: usize| src.get(s..e).unwrap_or("");
    while i < b.len() {
        let c = b[i];
        if c == b'\n' {
            line = line.saturating_add(1);
            i += 1;
        } else if c.is_ascii_whitespace() {
            i += 1;
        } else if c == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
            i += 2;
            while i < b.len() && !(b[i] == b'*' && b.get(i + 1) == Some(&b'/')) {
                if b[i] == b'\n' {
                    line = line.saturating_add(1);
                }
                i += 1;
            }
            i += 2;
        } else if c == b'"' {
            // Strings appear only in .file / .pragma; keep them as words.
            let start = i;
            i += 1;
            while i < b.len() && b[i] != b'"' && b[i] != b'\n' {
                i += 1;
            }
            i = (i + 1).min(b.len());
            emit(Token { tok: Tok::Word(text(start, i)), line });
        } else if c.is_ascii_digit() {
            let start = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'.' || ((b[i] == b'+' || b[i] == b'-') && matches!(b[i - 1], b'e' | b'E') && !is_hex_prefix(&b[start..i]))) {
                i += 1;
            }
            emit(Token { tok: number(text(start, i), line)?, line });
        } else if word_start(c) {
            let start = i;
            // Whether the word has a '.' so far, kept as it grows so that a
            // long word is scanned once.
            let mut dotted = false;
            loop {
                while i < b.len() && word_char(b[i]) {
                    dotted |= b[i] == b'.';
                    i += 1;
                }
                // Qualified modifiers (`.shared::cta`, `.L1::no_allocate`)
                // belong to the word; a label's ':' does not.
                if dotted && b.get(i) == Some(&b':') && b.get(i + 1) == Some(&b':') && b.get(i + 2).is_some_and(|c| word_char(*c)) {
                    i += 2;
                    continue;
                }
                break;
            }
            emit(Token { tok: Tok::Word(text(start, i)), line });
        } else if b",;:[]{}()+-!@<>|=".contains(&c) {
            emit(Token { tok: Tok::Punct(c as char), line });
            i += 1;
        } else {
            let ch = src.get(i..).and_then(|s| s.chars().next()).unwrap_or('?');
            return Err(PtxError::at(line, format!("unexpected character {ch:?}")));
        }
    }
    Ok(())
}

/// The number of tokens in `src`, without allocating them.
pub fn count(src: &str) -> Result<usize, PtxError> {
    let mut n = 0usize;
    scan(src, |_| n += 1)?;
    Ok(n)
}

/// Tokenizes `src` into a vector of exactly `count(src)` tokens.
pub fn lex(src: &str) -> Result<Vec<Token<'_>>, PtxError> {
    let mut out = Vec::with_capacity(count(src)?);
    scan(src, |t| out.push(t))?;
    Ok(out)
}

fn is_hex_prefix(s: &[u8]) -> bool {
    s.len() >= 2 && s[0] == b'0' && matches!(s[1], b'x' | b'X' | b'f' | b'F' | b'd' | b'D')
}

fn number(s: &str, line: u32) -> Result<Tok<'static>, PtxError> {
    let bad = || PtxError::at(line, format!("bad numeric literal '{s}'"));
    let t = s.trim_end_matches(['U', 'u']);
    if let Some(h) = t.strip_prefix("0f").or_else(|| t.strip_prefix("0F")) {
        if h.len() != 8 {
            return Err(bad());
        }
        return u32::from_str_radix(h, 16).map(Tok::F32).map_err(|_| bad());
    }
    if let Some(h) = t.strip_prefix("0d").or_else(|| t.strip_prefix("0D")) {
        if h.len() != 16 {
            return Err(bad());
        }
        return u64::from_str_radix(h, 16).map(Tok::F64).map_err(|_| bad());
    }
    if let Some(h) = t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        return u64::from_str_radix(h, 16).map(Tok::Int).map_err(|_| bad());
    }
    if let Some(h) = t.strip_prefix("0b").or_else(|| t.strip_prefix("0B")) {
        return u64::from_str_radix(h, 2).map(Tok::Int).map_err(|_| bad());
    }
    if t.contains(['.', 'e', 'E']) {
        return t.parse::<f64>().map(|f| Tok::F64(f.to_bits())).map_err(|_| bad());
    }
    if t.len() > 1 && t.starts_with('0') {
        return u64::from_str_radix(&t[1..], 8).map(Tok::Int).map_err(|_| bad());
    }
    t.parse::<u64>().map(Tok::Int).map_err(|_| bad())
}
