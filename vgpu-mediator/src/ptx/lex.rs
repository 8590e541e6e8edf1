//! PTX tokenizer. Comments are dropped; every token keeps its line for
//! error messages.

use super::PtxError;

#[derive(Debug, Clone, PartialEq)]
pub enum Tok {
    /// Identifiers, opcodes with their dotted modifiers, directives,
    /// registers (`%r1`, `%tid.x`) and labels.
    Word(String),
    /// Integer literal (decimal, hex, octal or binary), sign applied later.
    Int(u64),
    /// Float literal: `0f...` (f32 bits), `0d...` (f64 bits) or decimal.
    F32(u32),
    F64(u64),
    Punct(char),
}

#[derive(Debug, Clone)]
pub struct Token {
    pub tok: Tok,
    pub line: u32,
}

fn word_start(c: char) -> bool {
    c.is_ascii_alphabetic() || matches!(c, '_' | '.' | '%' | '$')
}

fn word_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '%' | '$')
}

pub fn lex(src: &str) -> Result<Vec<Token>, PtxError> {
    let b: Vec<char> = src.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    let mut line = 1u32;
    while i < b.len() {
        let c = b[i];
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if c == '/' && b.get(i + 1) == Some(&'/') {
            while i < b.len() && b[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && b.get(i + 1) == Some(&'*') {
            i += 2;
            while i < b.len() && !(b[i] == '*' && b.get(i + 1) == Some(&'/')) {
                if b[i] == '\n' {
                    line += 1;
                }
                i += 1;
            }
            i += 2;
        } else if c == '"' {
            // Strings appear only in .file / .pragma; keep them as words.
            let start = i;
            i += 1;
            while i < b.len() && b[i] != '"' && b[i] != '\n' {
                i += 1;
            }
            i += 1;
            let s: String = b[start..i.min(b.len())].iter().collect();
            out.push(Token { tok: Tok::Word(s), line });
        } else if c.is_ascii_digit() {
            let start = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == '.' || ((b[i] == '+' || b[i] == '-') && matches!(b[i - 1], 'e' | 'E') && !is_hex_prefix(&b[start..i]))) {
                i += 1;
            }
            let s: String = b[start..i].iter().collect();
            out.push(Token { tok: number(&s, line)?, line });
        } else if word_start(c) {
            let start = i;
            while i < b.len() && word_char(b[i]) {
                i += 1;
            }
            out.push(Token { tok: Tok::Word(b[start..i].iter().collect()), line });
        } else if ",;:[]{}()+-!@<>|=".contains(c) {
            out.push(Token { tok: Tok::Punct(c), line });
            i += 1;
        } else {
            return Err(PtxError::at(line, format!("unexpected character {c:?}")));
        }
    }
    Ok(out)
}

fn is_hex_prefix(s: &[char]) -> bool {
    s.len() >= 2 && s[0] == '0' && matches!(s[1], 'x' | 'X' | 'f' | 'F' | 'd' | 'D')
}

fn number(s: &str, line: u32) -> Result<Tok, PtxError> {
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
