//! PTX tokenizer. Comments are dropped; every token keeps its line for
//! error messages.
//!
//! Tokens borrow their text from the source. A parser takes them one
//! module-scope statement at a time ([`Statements`]), so what it holds
//! while it parses is one statement's tokens, not the module's, and it
//! charges them to the tenant as they are taken.

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

/// A resumable walk over a module's text: one token at a time, so a
/// parser holds only the tokens it is working on.
#[derive(Debug, Clone)]
pub struct Lexer<'a> {
    src: &'a str,
    i: usize,
    line: u32,
}

impl<'a> Lexer<'a> {
    pub fn new(src: &'a str) -> Lexer<'a> {
        Lexer { src, i: 0, line: 1 }
    }

    /// The line the walk has reached.
    pub fn line(&self) -> u32 {
        self.line
    }

    /// The next token, or `None` at the end of the text.
    pub fn next_token(&mut self) -> Result<Option<Token<'a>>, PtxError> {
        let (src, b) = (self.src, self.src.as_bytes());
        let mut i = self.i;
        // Slices below start and end on ASCII bytes, so they are char boundaries.
        let text = |s: usize, e: usize| src.get(s..e).unwrap_or("");
        let tok = loop {
            let Some(&c) = b.get(i) else { break None };
            if c == b'\n' {
                self.line = self.line.saturating_add(1);
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
                        self.line = self.line.saturating_add(1);
                    }
                    i += 1;
                }
                i = (i + 2).min(b.len());
            } else if c == b'"' {
                // Strings appear only in .file / .pragma; keep them as words.
                let start = i;
                i += 1;
                while i < b.len() && b[i] != b'"' && b[i] != b'\n' {
                    i += 1;
                }
                i = (i + 1).min(b.len());
                break Some(Tok::Word(text(start, i)));
            } else if c.is_ascii_digit() {
                let start = i;
                while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'.' || ((b[i] == b'+' || b[i] == b'-') && matches!(b[i - 1], b'e' | b'E') && !is_hex_prefix(&b[start..i]))) {
                    i += 1;
                }
                break Some(number(text(start, i), self.line)?);
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
                break Some(Tok::Word(text(start, i)));
            } else if b",;:[]{}()+-!@<>|=".contains(&c) {
                i += 1;
                break Some(Tok::Punct(c as char));
            } else {
                let ch = src.get(i..).and_then(|s| s.chars().next()).unwrap_or('?');
                return Err(PtxError::at(self.line, format!("unexpected character {ch:?}")));
            }
        };
        self.i = i;
        Ok(tok.map(|tok| Token { tok, line: self.line }))
    }
}

/// Module-scope statements, one after another: where a parser may let go
/// of the tokens before and take the next statement's. A statement ends
/// after a `;` or `}` outside braces, where a word (the next directive)
/// follows; so `= {1, 2};` and a body's closing brace stay with theirs.
#[derive(Debug, Clone)]
pub struct Statements<'a> {
    lexer: Lexer<'a>,
    /// The first token of the next statement, read to find this one's end.
    ahead: Option<Token<'a>>,
}

impl<'a> Statements<'a> {
    pub fn new(src: &'a str) -> Statements<'a> {
        Statements { lexer: Lexer::new(src), ahead: None }
    }

    /// Puts the next statement's tokens in `out` (in place of what it
    /// held), if it has at most `room` of them: they are counted first, so
    /// `out` is allocated at most once, for exactly that many, after its
    /// old buffer is freed (`Err(None)` past `room`, nothing taken).
    /// Returns whether there was a statement.
    pub fn next_into(&mut self, out: &mut Vec<Token<'a>>, room: usize) -> Result<bool, Option<PtxError>> {
        let mut n = 0usize;
        self.clone().walk(|_| {
            n += 1;
            n <= room
        })?;
        out.clear();
        if out.capacity() < n {
            // Freed before the larger one is taken, never both at once.
            *out = Vec::new();
            out.reserve_exact(n);
        }
        self.walk(|t| {
            out.push(t);
            true
        })
    }

    /// Hands the next statement's tokens to `take`, while it says go on
    /// (`Err(None)` once it says stop).
    fn walk(&mut self, mut take: impl FnMut(Token<'a>) -> bool) -> Result<bool, Option<PtxError>> {
        let mut depth = 0u32;
        let mut ended = false;
        let mut any = false;
        loop {
            let t = match self.ahead.take() {
                Some(t) => t,
                None => match self.lexer.next_token().map_err(Some)? {
                    Some(t) => t,
                    None => return Ok(any),
                },
            };
            if ended && depth == 0 && matches!(t.tok, Tok::Word(_)) {
                self.ahead = Some(t);
                return Ok(true);
            }
            match t.tok {
                Tok::Punct('{') => depth = depth.saturating_add(1),
                Tok::Punct('}') => depth = depth.saturating_sub(1),
                _ => {}
            }
            ended = depth == 0 && matches!(t.tok, Tok::Punct(';' | '}'));
            if !take(t) {
                return Err(None);
            }
            any = true;
        }
    }

    /// The line the walk has reached.
    pub fn line(&self) -> u32 {
        self.ahead.map_or(self.lexer.line(), |t| t.line)
    }
}

/// The number of tokens in `src`, without allocating them.
#[cfg(test)]
pub fn count(src: &str) -> Result<usize, PtxError> {
    let mut l = Lexer::new(src);
    let mut n = 0usize;
    while l.next_token()?.is_some() {
        n += 1;
    }
    Ok(n)
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
