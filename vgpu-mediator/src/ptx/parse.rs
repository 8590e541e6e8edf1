//! PTX text to [`Kernel`]s. Anything outside the documented subset is an
//! error that names the construct and its line (docs/ptx-subset.md).

use std::collections::HashMap;

use super::ir::*;
use super::lex::{self, lex, Tok, Token};
use super::PtxError;

/// A loaded module: its entry points, decoded once.
#[derive(Debug, Clone)]
pub struct Module {
    pub kernels: Vec<Kernel>,
}

impl Module {
    pub fn parse(src: &str) -> Result<Module, PtxError> {
        Self::parse_within(src, u64::MAX)
    }

    /// Parses `src` if its transient and retained host memory fit in
    /// `limit` bytes: the token count is taken before tokens are allocated,
    /// and the decoded form is measured before it is kept.
    pub fn parse_within(src: &str, limit: u64) -> Result<Module, PtxError> {
        let tokens = lex::count(src)? as u64;
        let transient = tokens.saturating_mul(lex::TOKEN_BYTES);
        if transient > limit {
            return Err(PtxError::over_budget(0, format!("parsing this module needs {transient} bytes of host memory for its {tokens} tokens; {limit} are left in the tenant's host budget")));
        }
        let toks = lex(src)?;
        let mut p = Parser { t: &toks, i: 0, module_shared: HashMap::new(), module_shared_bytes: 0, limit: limit - transient, decoded: 0 };
        p.module()
    }

    /// Host bytes the decoded module keeps, as charged to its tenant.
    pub fn host_bytes(&self) -> u64 {
        self.kernels.iter().map(Kernel::host_bytes).sum::<u64>() + std::mem::size_of::<Module>() as u64
    }

    pub fn kernel(&self, name: &str) -> Option<&Kernel> {
        self.kernels.iter().find(|k| k.name == name)
    }

    /// The parameter layout of every `.entry`, without decoding bodies:
    /// what a GPU backend needs to lay out launch parameters for PTX the
    /// interpreter itself may not support.
    pub fn signatures(src: &str, limit: u64) -> Result<Vec<Signature>, PtxError> {
        let transient = (lex::count(src)? as u64).saturating_mul(lex::TOKEN_BYTES);
        if transient > limit {
            return Err(PtxError::over_budget(0, format!("reading this module's signatures needs {transient} bytes of host memory; {limit} are left in the tenant's host budget")));
        }
        let toks = lex(src)?;
        let mut p = Parser { t: &toks, i: 0, module_shared: HashMap::new(), module_shared_bytes: 0, limit: u64::MAX, decoded: 0 };
        let mut out = Vec::new();
        while p.i < toks.len() {
            let entry = matches!(&toks[p.i].tok, Tok::Word(w) if *w == ".entry");
            p.i += 1;
            if entry {
                let name = p.word()?.to_string();
                let (params, params_size) = if p.is_punct('(') { p.params()? } else { (Vec::new(), 0) };
                out.push(Signature { name, params, params_size });
            }
        }
        Ok(out)
    }
}

/// A kernel's name and parameter layout.
#[derive(Debug, Clone, PartialEq)]
pub struct Signature {
    pub name: String,
    pub params: Vec<Param>,
    pub params_size: u32,
}

/// Deepest operand nesting the grammar has (`{a|b, ...}`, `!p`); anything
/// deeper is refused rather than recursed into.
const MAX_OPERAND_DEPTH: u32 = 3;
/// Most elements of a `{...}` operand: `.v4` and eight-way `mov` packs.
const MAX_VECTOR: usize = 8;
/// Largest `.align` a variable may ask for.
const MAX_ALIGN: u64 = 1 << 16;

struct Parser<'a> {
    t: &'a [Token<'a>],
    i: usize,
    /// Module-scope `.shared` variables: name to offset. Every kernel sees
    /// them; kernels look them up here rather than copying them.
    module_shared: HashMap<String, u32>,
    module_shared_bytes: u32,
    /// Host bytes the decoded kernels may take, and what they take so far.
    limit: u64,
    decoded: u64,
}

/// Operand as written, before it is resolved against a kernel's names.
#[derive(Debug, Clone)]
enum Raw {
    Name(String),
    Int(i128),
    F32(u32),
    F64(u64),
    Addr(Box<Raw>, i64),
    Vec(Vec<Raw>),
    Not(Box<Raw>),
    Pair(Box<Raw>, Box<Raw>),
    Sink,
}

struct Body<'k> {
    regs: HashMap<String, (u32, Ty)>,
    /// `.reg .t %r<N>` ranges: prefix to (first slot, count, type).
    reg_ranges: HashMap<String, (u32, u32, Ty)>,
    num_regs: u32,
    module_shared: &'k HashMap<String, u32>,
    shared: HashMap<String, u32>,
    shared_bytes: u32,
    params: &'k [Param],
    labels: HashMap<String, u32>,
    fixups: Vec<(usize, String, u32)>,
    insts: Vec<Inst>,
}

fn align_up(v: u32, a: u32) -> Option<u32> {
    if a <= 1 { Some(v) } else { v.div_ceil(a).checked_mul(a) }
}

impl Body<'_> {
    /// A register by name: declared singly, or as `%r<N>`'s member `%rK`.
    fn reg(&self, name: &str) -> Option<(u32, Ty)> {
        if let Some(r) = self.regs.get(name) {
            return Some(*r);
        }
        let prefix = name.trim_end_matches(|c: char| c.is_ascii_digit());
        let digits = &name[prefix.len()..];
        if digits.is_empty() || (digits.len() > 1 && digits.starts_with('0')) {
            return None;
        }
        let k: u32 = digits.parse().ok()?;
        let (base, n, ty) = *self.reg_ranges.get(prefix)?;
        (k < n).then_some((base + k, ty))
    }

    fn shared_var(&self, name: &str) -> Option<u32> {
        self.shared.get(name).or_else(|| self.module_shared.get(name)).copied()
    }
}

impl<'a> Parser<'a> {
    fn line(&self) -> u32 {
        self.t.get(self.i).or(self.t.last()).map(|t| t.line).unwrap_or(0)
    }

    fn err<T>(&self, msg: impl Into<String>) -> Result<T, PtxError> {
        Err(PtxError::at(self.line(), msg))
    }

    fn peek(&self) -> Option<&'a Tok<'a>> {
        self.t.get(self.i).map(|t| &t.tok)
    }

    fn next(&mut self) -> Result<&'a Tok<'a>, PtxError> {
        let t = self.t.get(self.i).map(|t| &t.tok);
        match t {
            Some(t) => {
                self.i += 1;
                Ok(t)
            }
            None => self.err("unexpected end of module"),
        }
    }

    fn is_punct(&self, c: char) -> bool {
        self.peek() == Some(&Tok::Punct(c))
    }

    fn expect_punct(&mut self, c: char) -> Result<(), PtxError> {
        match self.next()? {
            Tok::Punct(x) if *x == c => Ok(()),
            other => self.err(format!("expected '{c}', found {}", show(other))),
        }
    }

    fn word(&mut self) -> Result<&'a str, PtxError> {
        match self.next()? {
            Tok::Word(w) => Ok(w),
            other => self.err(format!("expected a name, found {}", show(other))),
        }
    }

    fn int(&mut self) -> Result<u64, PtxError> {
        match self.next()? {
            Tok::Int(v) => Ok(*v),
            other => self.err(format!("expected an integer, found {}", show(other))),
        }
    }

    fn skip_line(&mut self) {
        let line = self.line();
        while self.i < self.t.len() && self.t[self.i].line == line {
            self.i += 1;
        }
    }

    fn skip_to_semicolon(&mut self) -> Result<(), PtxError> {
        while !self.is_punct(';') {
            self.next()?;
        }
        self.next().map(|_| ())
    }

    fn skip_braces(&mut self) -> Result<(), PtxError> {
        self.expect_punct('{')?;
        let mut depth = 1;
        while depth > 0 {
            match self.next()? {
                Tok::Punct('{') => depth += 1,
                Tok::Punct('}') => depth -= 1,
                _ => {}
            }
        }
        Ok(())
    }

    fn module(&mut self) -> Result<Module, PtxError> {
        let mut kernels = Vec::new();
        while let Some(t) = self.peek() {
            let Tok::Word(w) = t else {
                return self.err(format!("unexpected {} at module scope", show(t)));
            };
            match *w {
                ".version" | ".target" | ".file" | ".loc" => self.skip_line(),
                ".address_size" => {
                    self.i += 1;
                    let n = self.int()?;
                    if n != 64 {
                        return self.err(format!(".address_size {n} is unsupported: only 64-bit addressing"));
                    }
                }
                ".visible" | ".extern" | ".weak" | ".common" => {
                    // `.extern .shared` is the dynamic shared array.
                    self.i += 1;
                }
                ".entry" => {
                    self.i += 1;
                    kernels.push(self.entry()?);
                }
                ".func" => {
                    // Device functions are parsed past; a `call` to one is an error.
                    self.i += 1;
                    while !self.is_punct('{') && !self.is_punct(';') {
                        self.next()?;
                    }
                    if self.is_punct('{') { self.skip_braces()? } else { self.i += 1 }
                }
                ".shared" => {
                    self.i += 1;
                    let (name, size, align) = self.var_decl()?;
                    let offset = align_up(self.module_shared_bytes, align).ok_or_else(|| PtxError::at(self.line(), "shared memory overflow"))?;
                    self.module_shared_bytes = offset.checked_add(size).ok_or_else(|| PtxError::at(self.line(), "shared memory overflow"))?;
                    self.module_shared.insert(name, offset);
                }
                ".global" | ".const" | ".local" | ".tex" | ".surf" | ".sampler" => {
                    return self.err(format!("module-scope {w} variables are unsupported on the CPU reference device"));
                }
                ".section" => {
                    self.i += 1;
                    self.word()?;
                    self.skip_braces()?;
                }
                ".pragma" => self.skip_to_semicolon()?,
                _ => return self.err(format!("unsupported module directive '{w}'")),
            }
        }
        Ok(Module { kernels })
    }

    /// `[.align N] [.vN] .type name [dims]* ;` after a state-space directive.
    /// Returns (name, size in bytes, alignment). `[]` is a dynamic array of size 0.
    fn var_decl(&mut self) -> Result<(String, u32, u32), PtxError> {
        let mut align = 0u32;
        let mut vec = 1u32;
        let mut ty = None;
        loop {
            let w = self.word()?;
            match w {
                ".align" => align = self.align()?,
                ".v2" => vec = 2,
                ".v4" => vec = 4,
                _ if w.starts_with('.') => match Ty::parse(&w[1..]) {
                    Some(t) => ty = Some(t),
                    None => return self.err(format!("unsupported variable type '{w}'")),
                },
                name => {
                    let ty = ty.ok_or_else(|| PtxError::at(self.line(), format!("variable '{name}' has no type")))?;
                    let mut size = (ty.bytes() as u64) * vec as u64;
                    while self.is_punct('[') {
                        self.i += 1;
                        if self.is_punct(']') {
                            size = 0;
                        } else {
                            size = size.saturating_mul(self.int()?);
                        }
                        self.expect_punct(']')?;
                    }
                    if self.is_punct('=') {
                        return self.err(format!("initialised variable '{name}' is unsupported"));
                    }
                    self.expect_punct(';')?;
                    if size > 1 << 20 {
                        return self.err(format!("variable '{name}' of {size} bytes is too large"));
                    }
                    let align = if align == 0 { ty.bytes() as u32 * vec } else { align };
                    return Ok((name.to_string(), size as u32, align.max(1)));
                }
            }
        }
    }

    /// The operand of `.align`: a power of two no larger than [`MAX_ALIGN`].
    fn align(&mut self) -> Result<u32, PtxError> {
        let a = self.int()?;
        if !a.is_power_of_two() || a > MAX_ALIGN {
            return self.err(format!(".align {a} is not a power of two up to {MAX_ALIGN}"));
        }
        Ok(a as u32)
    }

    fn params(&mut self) -> Result<(Vec<Param>, u32), PtxError> {
        let mut params = Vec::new();
        let mut off = 0u32;
        self.expect_punct('(')?;
        while !self.is_punct(')') {
            if self.word()? != ".param" {
                return self.err("expected .param in kernel signature");
            }
            let mut align = 0u32;
            let mut ty = None;
            let name = loop {
                let w = self.word()?;
                match w {
                    ".align" => align = self.align()?,
                    ".ptr" | ".global" | ".shared" | ".const" | ".local" => {}
                    _ if w.starts_with('.') => match Ty::parse(&w[1..]) {
                        Some(t) if t != Ty::Pred => ty = Some(t),
                        _ => return self.err(format!("unsupported parameter type '{w}'")),
                    },
                    n => break n.to_string(),
                }
            };
            let ty = ty.ok_or_else(|| PtxError::at(self.line(), format!("parameter '{name}' has no type")))?;
            let mut size = ty.bytes() as u32;
            if self.is_punct('[') {
                self.i += 1;
                size = size.saturating_mul(self.int()? as u32);
                self.expect_punct(']')?;
            }
            let align = if align == 0 { ty.bytes() as u32 } else { align };
            if !align.is_power_of_two() || align > 256 {
                return self.err(format!("bad alignment {align} for parameter '{name}'"));
            }
            off = align_up(off, align).unwrap_or(u32::MAX);
            if size == 0 || off.saturating_add(size) > virtio_gpu_compute::MAX_PARAM_BYTES {
                return self.err(format!("parameter '{name}' does not fit the {}-byte parameter space", virtio_gpu_compute::MAX_PARAM_BYTES));
            }
            params.push(Param { name, offset: off, size });
            off += size;
            if self.is_punct(',') {
                self.i += 1;
            }
        }
        self.expect_punct(')')?;
        Ok((params, off))
    }

    fn entry(&mut self) -> Result<Kernel, PtxError> {
        let name = self.word()?.to_string();
        let (params, params_size) = if self.is_punct('(') { self.params()? } else { (Vec::new(), 0) };
        // Performance directives (.maxntid, .reqntid, ...) up to the body.
        while !self.is_punct('{') {
            match self.next()? {
                Tok::Punct(';') => return self.err(format!("kernel '{name}' has no body")),
                _ => {}
            }
        }
        self.i += 1;
        let module_shared = std::mem::take(&mut self.module_shared);
        let r = self.body(name, params, params_size, &module_shared);
        self.module_shared = module_shared;
        let k = r?;
        self.decoded = self.decoded.saturating_add(k.host_bytes());
        if self.decoded > self.limit {
            return Err(PtxError::over_budget(self.line(), format!("the decoded module needs more than {} bytes of host memory, the rest of the tenant's host budget", self.limit)));
        }
        Ok(k)
    }

    fn body(&mut self, name: String, params: Vec<Param>, params_size: u32, module_shared: &HashMap<String, u32>) -> Result<Kernel, PtxError> {
        let mut b = Body {
            regs: HashMap::new(),
            reg_ranges: HashMap::new(),
            num_regs: 0,
            module_shared,
            shared: HashMap::new(),
            shared_bytes: self.module_shared_bytes,
            params: &params,
            labels: HashMap::new(),
            fixups: Vec::new(),
            insts: Vec::new(),
        };
        let mut depth = 1;
        while depth > 0 {
            if b.insts.len() % 1024 == 1023 && self.decoded.saturating_add((b.insts.capacity() * std::mem::size_of::<Inst>()) as u64) > self.limit {
                return Err(PtxError::over_budget(self.line(), format!("the decoded module needs more than {} bytes of host memory, the rest of the tenant's host budget", self.limit)));
            }
            let line = self.line();
            match self.next()? {
                Tok::Punct('{') => depth += 1,
                Tok::Punct('}') => depth -= 1,
                Tok::Punct('@') => {
                    let neg = if self.is_punct('!') {
                        self.i += 1;
                        true
                    } else {
                        false
                    };
                    let g = self.word()?;
                    let (slot, ty) = b.reg(g).ok_or_else(|| PtxError::at(line, format!("unknown guard predicate '{g}'")))?;
                    if ty != Ty::Pred {
                        return Err(PtxError::at(line, format!("guard '{g}' is not a predicate")));
                    }
                    let opw = self.word()?;
                    self.instruction(&mut b, opw, Some((slot, neg)), line)?;
                }
                Tok::Word(w) => match *w {
                    ".reg" => self.reg_decl(&mut b)?,
                    ".shared" => {
                        let (n, size, align) = self.var_decl()?;
                        let offset = align_up(b.shared_bytes, align).ok_or_else(|| PtxError::at(line, "shared memory overflow"))?;
                        b.shared_bytes = offset.checked_add(size).ok_or_else(|| PtxError::at(line, "shared memory overflow"))?;
                        b.shared.insert(n, offset);
                    }
                    ".pragma" => self.skip_to_semicolon()?,
                    ".loc" | ".file" => {
                        self.i -= 1;
                        self.skip_line();
                    }
                    ".local" => return Err(PtxError::at(line, "'.local' memory is unsupported on the CPU reference device")),
                    d if d.starts_with('.') => return Err(PtxError::at(line, format!("unsupported directive '{d}' in kernel body"))),
                    label if self.is_punct(':') => {
                        self.i += 1;
                        b.labels.insert(label.to_string(), b.insts.len() as u32);
                    }
                    opw => self.instruction(&mut b, opw, None, line)?,
                },
                other => return Err(PtxError::at(line, format!("unexpected {}", show(other)))),
            }
        }
        for (idx, label, line) in std::mem::take(&mut b.fixups) {
            let target = *b.labels.get(&label).ok_or_else(|| PtxError::at(line, format!("unknown label '{label}'")))?;
            if let Op::Bra { target: t } = &mut b.insts[idx].op {
                *t = target;
            }
        }
        // Falling off the end of a kernel exits.
        b.insts.push(Inst { guard: None, op: Op::Exit, line: self.line() });
        let Body { insts, num_regs, shared_bytes, .. } = b;
        Ok(Kernel { name, params, params_size, insts, num_regs, shared_bytes })
    }

    fn reg_decl(&mut self, b: &mut Body<'_>) -> Result<(), PtxError> {
        let tw = self.word()?;
        let ty = tw.strip_prefix('.').and_then(Ty::parse).ok_or_else(|| PtxError::at(self.line(), format!("unsupported register type '{tw}'")))?;
        loop {
            let name = self.word()?.to_string();
            let count = if self.is_punct('<') {
                self.i += 1;
                let n = self.int()?;
                self.expect_punct('>')?;
                if n > 1 << 16 {
                    return self.err(format!("too many registers in '{name}<{n}>'"));
                }
                Some(n as u32)
            } else {
                None
            };
            let n = count.unwrap_or(1);
            if b.num_regs.saturating_add(n) > 1 << 16 {
                return self.err("too many registers");
            }
            match count {
                Some(n) => {
                    b.reg_ranges.insert(name, (b.num_regs, n, ty));
                }
                None => {
                    b.regs.insert(name, (b.num_regs, ty));
                }
            }
            b.num_regs += n;
            match self.next()? {
                Tok::Punct(',') => continue,
                Tok::Punct(';') => return Ok(()),
                other => return self.err(format!("expected ',' or ';' in .reg, found {}", show(other))),
            }
        }
    }

    fn raw_operand(&mut self) -> Result<Raw, PtxError> {
        self.operand_at(0)
    }

    /// One operand at nesting `depth`; nesting past [`MAX_OPERAND_DEPTH`] is
    /// an error, so hostile input cannot exhaust the worker's stack.
    fn operand_at(&mut self, depth: u32) -> Result<Raw, PtxError> {
        if depth > MAX_OPERAND_DEPTH {
            return self.err("operand nested too deeply");
        }
        let first = match self.next()? {
            Tok::Punct('[') => {
                let base = match self.next()? {
                    Tok::Word(w) => Raw::Name(w.to_string()),
                    Tok::Int(v) => Raw::Int(*v as i128),
                    other => return self.err(format!("bad address base {}", show(other))),
                };
                let mut off = 0i64;
                if self.is_punct('+') || self.is_punct('-') {
                    let mut neg = self.is_punct('-');
                    self.i += 1;
                    if self.is_punct('-') {
                        neg = !neg;
                        self.i += 1;
                    }
                    let v = self.int()?;
                    let v = i64::try_from(v).map_err(|_| PtxError::at(self.line(), "address offset out of range"))?;
                    off = if neg { -v } else { v };
                }
                self.expect_punct(']')?;
                Raw::Addr(Box::new(base), off)
            }
            Tok::Punct('{') => {
                let mut v = Vec::new();
                loop {
                    if v.len() == MAX_VECTOR {
                        return self.err(format!("vector operand with more than {MAX_VECTOR} elements"));
                    }
                    v.push(self.operand_at(depth + 1)?);
                    match self.next()? {
                        Tok::Punct(',') => continue,
                        Tok::Punct('}') => break,
                        other => return self.err(format!("expected ',' or '}}' in vector, found {}", show(other))),
                    }
                }
                Raw::Vec(v)
            }
            Tok::Punct('!') => Raw::Not(Box::new(self.operand_at(depth + 1)?)),
            Tok::Punct('-') => match self.next()? {
                Tok::Int(v) => Raw::Int(-(*v as i128)),
                Tok::F32(b) => Raw::F32(b ^ 0x8000_0000),
                Tok::F64(b) => Raw::F64(b ^ (1 << 63)),
                other => return self.err(format!("bad negative operand {}", show(other))),
            },
            Tok::Int(v) => Raw::Int(*v as i128),
            Tok::F32(b) => Raw::F32(*b),
            Tok::F64(b) => Raw::F64(*b),
            Tok::Word(w) if *w == "_" => Raw::Sink,
            Tok::Word(w) => Raw::Name(w.to_string()),
            other => return self.err(format!("bad operand {}", show(other))),
        };
        if self.is_punct('|') {
            self.i += 1;
            let second = self.operand_at(depth + 1)?;
            return Ok(Raw::Pair(Box::new(first), Box::new(second)));
        }
        Ok(first)
    }

    fn instruction(&mut self, b: &mut Body<'_>, opw: &str, guard: Option<(u32, bool)>, line: u32) -> Result<(), PtxError> {
        let base = opw.split('.').next().unwrap_or("");
        if !KNOWN_OPCODES.contains(&base) {
            return Err(PtxError::at(line, format!("unsupported instruction '{opw}'")));
        }
        let mut ops = Vec::new();
        if !self.is_punct(';') {
            loop {
                ops.push(self.raw_operand()?);
                match self.next()? {
                    Tok::Punct(',') => continue,
                    Tok::Punct(';') => break,
                    other => return Err(PtxError::at(line, format!("expected ',' or ';' after operand of '{opw}', found {}", show(other)))),
                }
            }
        } else {
            self.i += 1;
        }
        let cx = Cx { b, line, opw };
        let (op, label) = cx.decode(&ops)?;
        if let Some(l) = label {
            b.fixups.push((b.insts.len(), l, line));
        }
        b.insts.push(Inst { guard, op, line });
        Ok(())
    }
}

/// Base opcodes the decoder understands; anything else is reported by name
/// before its operands are parsed.
const KNOWN_OPCODES: &[&str] = &[
    "mov", "ld", "ldu", "st", "cvta", "cvt", "add", "sub", "mul", "div", "rem", "min", "max", "and", "or", "xor",
    "shl", "shr", "copysign", "neg", "abs", "not", "sqrt", "rsqrt", "rcp", "ex2", "lg2", "sin", "cos", "popc",
    "clz", "brev", "cnot", "mad", "fma", "setp", "selp", "bra", "brx", "bar", "barrier", "membar", "fence", "shfl",
    "vote", "atom", "red", "ret", "exit",
];

fn show(t: &Tok) -> String {
    match t {
        Tok::Word(w) => format!("'{w}'"),
        Tok::Int(v) => format!("'{v}'"),
        Tok::F32(v) => format!("'0f{v:08X}'"),
        Tok::F64(v) => format!("'0d{v:016X}'"),
        Tok::Punct(c) => format!("'{c}'"),
    }
}

fn special(name: &str) -> Option<Special> {
    let dim = |s: &str| match s {
        "x" => Some(0u8),
        "y" => Some(1),
        "z" => Some(2),
        _ => None,
    };
    if let Some((reg, d)) = name.split_once('.') {
        let d = dim(d)?;
        return Some(match reg {
            "%tid" => Special::Tid(d),
            "%ntid" => Special::Ntid(d),
            "%ctaid" => Special::Ctaid(d),
            "%nctaid" => Special::Nctaid(d),
            _ => return None,
        });
    }
    Some(match name {
        "%tid" | "%ntid" | "%ctaid" | "%nctaid" => return None,
        "%laneid" => Special::LaneId,
        "%warpid" => Special::WarpId,
        "%nwarpid" => Special::NWarpId,
        "%clock" => Special::Clock,
        "%clock64" => Special::Clock64,
        "%lanemask_eq" => Special::LaneMaskEq,
        "%lanemask_lt" => Special::LaneMaskLt,
        "%lanemask_le" => Special::LaneMaskLe,
        "%lanemask_gt" => Special::LaneMaskGt,
        "%lanemask_ge" => Special::LaneMaskGe,
        _ => return None,
    })
}

/// Decoding context for one instruction.
struct Cx<'b, 'k, 'o> {
    b: &'b Body<'k>,
    line: u32,
    opw: &'o str,
}

impl Cx<'_, '_, '_> {
    fn err<T>(&self, msg: impl Into<String>) -> Result<T, PtxError> {
        Err(PtxError::at(self.line, format!("'{}': {}", self.opw, msg.into())))
    }

    fn unsupported<T>(&self) -> Result<T, PtxError> {
        Err(PtxError::at(self.line, format!("unsupported instruction '{}'", self.opw)))
    }

    fn reg(&self, r: &Raw) -> Result<u32, PtxError> {
        match r {
            Raw::Name(n) => match self.b.reg(n) {
                Some((slot, _)) => Ok(slot),
                None => self.err(format!("unknown register '{n}'")),
            },
            other => self.err(format!("expected a register, found {other:?}")),
        }
    }

    fn reg_bits(&self, r: &Raw) -> u32 {
        match r {
            Raw::Name(n) => self.b.reg(n).map(|(_, t)| t.bits()).unwrap_or(64),
            _ => 64,
        }
    }

    fn opt_reg(&self, r: &Raw) -> Result<Option<u32>, PtxError> {
        if matches!(r, Raw::Sink) { Ok(None) } else { self.reg(r).map(Some) }
    }

    fn src(&self, r: &Raw, ty: Ty) -> Result<Src, PtxError> {
        Ok(match r {
            Raw::Name(n) => {
                if let Some((slot, _)) = self.b.reg(n) {
                    Src::Reg(slot)
                } else if let Some(s) = special(n) {
                    Src::Special(s)
                } else if n == "WARP_SZ" {
                    Src::Imm(32)
                } else if let Some(off) = self.b.shared_var(n) {
                    Src::Imm(off as u64)
                } else {
                    return self.err(format!("unknown operand '{n}'"));
                }
            }
            Raw::Int(v) => Src::Imm(match ty {
                Ty::F32 => (*v as f32).to_bits() as u64,
                Ty::F64 => (*v as f64).to_bits(),
                _ => ty.mask(*v as u64),
            }),
            Raw::F32(bits) => Src::Imm(match ty {
                Ty::F64 => (f32::from_bits(*bits) as f64).to_bits(),
                _ => *bits as u64,
            }),
            Raw::F64(bits) => Src::Imm(match ty {
                Ty::F32 => (f64::from_bits(*bits) as f32).to_bits() as u64,
                _ => *bits,
            }),
            other => return self.err(format!("bad source operand {other:?}")),
        })
    }

    fn addr(&self, r: &Raw, space: Space) -> Result<Addr, PtxError> {
        let Raw::Addr(base, offset) = r else {
            return self.err("expected an address [..]");
        };
        let base = match &**base {
            Raw::Name(n) if space == Space::Param => match self.b.params.iter().find(|p| &p.name == n) {
                Some(p) => Src::Imm(p.offset as u64),
                None => return self.err(format!("unknown parameter '{n}'")),
            },
            Raw::Name(n) if self.b.reg(n).is_some() => self.src(&Raw::Name(n.clone()), Ty::U64)?,
            Raw::Name(n) => match self.b.shared_var(n) {
                Some(off) if matches!(space, Space::Shared) => Src::Imm(off as u64),
                Some(off) if matches!(space, Space::Generic) => Src::Imm(super::exec::SHARED_WINDOW + off as u64),
                _ => return self.err(format!("unknown address base '{n}'")),
            },
            Raw::Int(v) => Src::Imm(*v as u64),
            other => return self.err(format!("bad address base {other:?}")),
        };
        Ok(Addr { base, offset: *offset })
    }

    /// Returns the decoded op and, for branches, the label to resolve.
    fn decode(&self, ops: &[Raw]) -> Result<(Op, Option<String>), PtxError> {
        let mut parts = self.opw.split('.');
        let base = parts.next().unwrap_or("");
        let mods: Vec<&str> = parts.collect();
        let has = |m: &str| mods.contains(&m);
        let types: Vec<Ty> = mods.iter().filter_map(|m| Ty::parse(m)).collect();
        let ty = types.last().copied();
        let need = |n: usize| -> Result<(), PtxError> {
            if ops.len() != n { self.err(format!("expected {n} operands, found {}", ops.len())) } else { Ok(()) }
        };
        let space = || {
            if has("global") { Space::Global } else if has("shared") { Space::Shared } else if has("param") { Space::Param } else { Space::Generic }
        };
        let the_ty = || ty.ok_or_else(|| PtxError::at(self.line, format!("'{}': missing type", self.opw)));
        let op = match base {
            "mov" => {
                need(2)?;
                let ty = the_ty()?;
                match (&ops[0], &ops[1]) {
                    (Raw::Vec(d), a) => {
                        let d = d.iter().map(|r| self.reg(r)).collect::<Result<Vec<_>, _>>()?;
                        let part_bits = ty.bits() / d.len() as u32;
                        Op::Unpack { a: self.src(a, ty)?, d, part_bits }
                    }
                    (d, Raw::Vec(s)) => {
                        let part_bits = ty.bits() / s.len() as u32;
                        let s = s.iter().map(|r| self.src(r, Ty::B64)).collect::<Result<Vec<_>, _>>()?;
                        Op::Pack { d: self.reg(d)?, s, part_bits }
                    }
                    (d, a) => Op::Mov { ty, d: self.reg(d)?, a: self.src(a, ty)? },
                }
            }
            "ld" | "ldu" => {
                need(2)?;
                if has("const") || has("local") || has("tex") {
                    return self.err("only .param, .global and .shared loads (and generic ones) are supported");
                }
                let ty = the_ty()?;
                let (d, dst_bits) = match &ops[0] {
                    Raw::Vec(v) => (v.iter().map(|r| self.reg(r)).collect::<Result<Vec<_>, _>>()?, self.reg_bits(&v[0])),
                    r => (vec![self.reg(r)?], self.reg_bits(r)),
                };
                Op::Ld { space: space(), ty, d, addr: self.addr(&ops[1], space())?, dst_bits }
            }
            "st" => {
                need(2)?;
                if has("const") || has("local") || has("param") {
                    return self.err("only .global and .shared stores (and generic ones) are supported");
                }
                let ty = the_ty()?;
                let s = match &ops[1] {
                    Raw::Vec(v) => v.iter().map(|r| self.src(r, ty)).collect::<Result<Vec<_>, _>>()?,
                    r => vec![self.src(r, ty)?],
                };
                Op::St { space: space(), ty, addr: self.addr(&ops[0], space())?, s }
            }
            "cvta" => {
                need(2)?;
                let shared = has("shared");
                if !shared && !has("global") {
                    return self.err("only .global and .shared windows are supported");
                }
                let ty = the_ty()?;
                Op::Cvta { to_generic: !has("to"), shared, d: self.reg(&ops[0])?, a: self.src(&ops[1], ty)? }
            }
            "cvt" => {
                need(2)?;
                if types.len() != 2 {
                    return self.err("expected destination and source types");
                }
                let round = if has("rn") { Round::Rn } else if has("rz") { Round::Rz } else if has("rm") { Round::Rm } else if has("rp") { Round::Rp }
                    else if has("rni") { Round::Rni } else if has("rzi") { Round::Rzi } else if has("rmi") { Round::Rmi } else if has("rpi") { Round::Rpi } else { Round::Default };
                Op::Cvt { dty: types[0], sty: types[1], round, sat: has("sat"), d: self.reg(&ops[0])?, a: self.src(&ops[1], types[1])? }
            }
            "add" | "sub" | "mul" | "div" | "rem" | "min" | "max" | "and" | "or" | "xor" | "shl" | "shr" | "copysign" => {
                if has("cc") || mods.iter().any(|m| m.starts_with("relu") || *m == "NaN" || *m == "xorsign") {
                    return self.unsupported();
                }
                need(3)?;
                let ty = the_ty()?;
                let op = match base {
                    "add" => Bin::Add,
                    "sub" => Bin::Sub,
                    "mul" if has("wide") => Bin::MulWide,
                    "mul" if has("hi") => Bin::MulHi,
                    "mul" => Bin::MulLo,
                    "div" => Bin::Div,
                    "rem" => Bin::Rem,
                    "min" => Bin::Min,
                    "max" => Bin::Max,
                    "and" => Bin::And,
                    "or" => Bin::Or,
                    "xor" => Bin::Xor,
                    "shl" => Bin::Shl,
                    "shr" => Bin::Shr,
                    _ => Bin::Copysign,
                };
                // Shift amounts are always .u32.
                let bty = if matches!(op, Bin::Shl | Bin::Shr) { Ty::U32 } else { ty };
                Op::Bin { op, ty, d: self.reg(&ops[0])?, a: self.src(&ops[1], ty)?, b: self.src(&ops[2], bty)? }
            }
            "neg" | "abs" | "not" | "sqrt" | "rsqrt" | "rcp" | "ex2" | "lg2" | "sin" | "cos" | "popc" | "clz" | "brev" | "cnot" => {
                need(2)?;
                let ty = the_ty()?;
                let op = match base {
                    "neg" => Un::Neg, "abs" => Un::Abs, "not" => Un::Not, "sqrt" => Un::Sqrt, "rsqrt" => Un::Rsqrt,
                    "rcp" => Un::Rcp, "ex2" => Un::Ex2, "lg2" => Un::Lg2, "sin" => Un::Sin, "cos" => Un::Cos,
                    "popc" => Un::Popc, "clz" => Un::Clz, "brev" => Un::Brev, _ => Un::Cnot,
                };
                Op::Un { op, ty, d: self.reg(&ops[0])?, a: self.src(&ops[1], ty)? }
            }
            "mad" | "fma" => {
                need(4)?;
                let ty = the_ty()?;
                if has("cc") {
                    return self.unsupported();
                }
                let (d, a, b, c) = (self.reg(&ops[0])?, &ops[1], &ops[2], &ops[3]);
                if ty.is_float() {
                    Op::Fma { ty, d, a: self.src(a, ty)?, b: self.src(b, ty)?, c: self.src(c, ty)?, sat: has("sat") }
                } else {
                    let mode = if has("wide") { MadMode::Wide } else if has("hi") { MadMode::Hi } else { MadMode::Lo };
                    let cty = if mode == MadMode::Wide { wide(ty) } else { ty };
                    Op::Mad { mode, ty, d, a: self.src(a, ty)?, b: self.src(b, ty)?, c: self.src(c, cty)? }
                }
            }
            "setp" => {
                if ops.len() != 3 && ops.len() != 4 {
                    return self.err("expected 3 or 4 operands");
                }
                let ty = the_ty()?;
                let cmp = mods.iter().find_map(|m| cmp(m)).ok_or_else(|| PtxError::at(self.line, format!("'{}': missing comparison", self.opw)))?;
                let (p, q) = match &ops[0] {
                    Raw::Pair(p, q) => (self.reg(p)?, self.opt_reg(q)?),
                    p => (self.reg(p)?, None),
                };
                let comb = if ops.len() == 4 {
                    let bop = if has("and") { BoolOp::And } else if has("or") { BoolOp::Or } else if has("xor") { BoolOp::Xor } else {
                        return self.err("a fourth operand needs .and, .or or .xor");
                    };
                    let (c, neg) = match &ops[3] { Raw::Not(c) => (&**c, true), c => (c, false) };
                    Some((bop, self.src(c, Ty::Pred)?, neg))
                } else {
                    None
                };
                Op::Setp { cmp, ty, p, q, a: self.src(&ops[1], ty)?, b: self.src(&ops[2], ty)?, comb }
            }
            "selp" => {
                need(4)?;
                let ty = the_ty()?;
                Op::Selp { ty, d: self.reg(&ops[0])?, a: self.src(&ops[1], ty)?, b: self.src(&ops[2], ty)?, p: self.src(&ops[3], Ty::Pred)? }
            }
            "bra" | "brx" => {
                if base == "brx" {
                    return self.unsupported();
                }
                need(1)?;
                let Raw::Name(l) = &ops[0] else { return self.err("expected a label") };
                return Ok((Op::Bra { target: 0 }, Some(l.clone())));
            }
            "bar" | "barrier" => {
                if has("warp") {
                    Op::Nop
                } else if has("sync") || has("cta") || base == "barrier" {
                    if ops.len() > 1 {
                        return self.err("barriers with a thread count are unsupported");
                    }
                    Op::Bar
                } else {
                    return self.unsupported();
                }
            }
            "membar" | "fence" => Op::Nop,
            "shfl" => {
                if !has("sync") {
                    return self.err("only shfl.sync is supported");
                }
                need(5)?;
                let mode = if has("up") { ShflMode::Up } else if has("down") { ShflMode::Down } else if has("bfly") { ShflMode::Bfly } else if has("idx") { ShflMode::Idx } else {
                    return self.err("missing shuffle mode");
                };
                let (d, p) = match &ops[0] {
                    Raw::Pair(d, p) => (self.reg(d)?, self.opt_reg(p)?),
                    d => (self.reg(d)?, None),
                };
                Op::Shfl { mode, d, p, a: self.src(&ops[1], Ty::B32)?, b: self.src(&ops[2], Ty::U32)?, c: self.src(&ops[3], Ty::U32)? }
            }
            "vote" => {
                if !has("sync") {
                    return self.err("only vote.sync is supported");
                }
                need(3)?;
                let mode = if has("all") { VoteMode::All } else if has("any") { VoteMode::Any } else if has("uni") { VoteMode::Uni } else if has("ballot") { VoteMode::Ballot } else {
                    return self.err("missing vote mode");
                };
                let (a, negate) = match &ops[1] { Raw::Not(a) => (&**a, true), a => (a, false) };
                Op::Vote { mode, d: self.reg(&ops[0])?, a: self.src(a, Ty::Pred)?, negate }
            }
            "atom" | "red" => {
                let ty = the_ty()?;
                let aop = mods.iter().find_map(|m| Some(match *m {
                    "add" => AtomOp::Add, "min" => AtomOp::Min, "max" => AtomOp::Max, "exch" => AtomOp::Exch,
                    "cas" => AtomOp::Cas, "and" => AtomOp::And, "or" => AtomOp::Or, "xor" => AtomOp::Xor,
                    "inc" => AtomOp::Inc, "dec" => AtomOp::Dec, _ => return None,
                })).ok_or_else(|| PtxError::at(self.line, format!("'{}': missing atomic operation", self.opw)))?;
                if ty.bits() < 32 || (ty.is_float() && aop != AtomOp::Add && aop != AtomOp::Exch) {
                    return self.unsupported();
                }
                let sp = space();
                if sp == Space::Param {
                    return self.err("atomics on .param are invalid");
                }
                let (d, rest) = if base == "atom" {
                    (Some(self.reg(ops.first().ok_or_else(|| PtxError::at(self.line, "missing operands"))?)?), ops.get(1..).unwrap_or(&[]))
                } else {
                    (None, ops)
                };
                let want = if aop == AtomOp::Cas { 3 } else { 2 };
                if rest.len() != want {
                    return self.err(format!("expected {} operands", want + d.is_some() as usize));
                }
                let c = if aop == AtomOp::Cas { Some(self.src(&rest[2], ty)?) } else { None };
                Op::Atom { space: sp, op: aop, ty, d, addr: self.addr(&rest[0], sp)?, b: self.src(&rest[1], ty)?, c }
            }
            "ret" | "exit" => Op::Exit,
            _ => return self.unsupported(),
        };
        Ok((op, None))
    }
}

fn wide(t: Ty) -> Ty {
    match t {
        Ty::U16 => Ty::U32, Ty::S16 => Ty::S32, Ty::U32 => Ty::U64, Ty::S32 => Ty::S64, other => other,
    }
}

fn cmp(m: &str) -> Option<Cmp> {
    Some(match m {
        "eq" => Cmp::Eq, "ne" => Cmp::Ne, "lt" => Cmp::Lt, "le" => Cmp::Le, "gt" => Cmp::Gt, "ge" => Cmp::Ge,
        "lo" => Cmp::Lo, "ls" => Cmp::Ls, "hi" => Cmp::Hi, "hs" => Cmp::Hs,
        "equ" => Cmp::Equ, "neu" => Cmp::Neu, "ltu" => Cmp::Ltu, "leu" => Cmp::Leu, "gtu" => Cmp::Gtu, "geu" => Cmp::Geu,
        "num" => Cmp::Num, "nan" => Cmp::Nan,
        _ => return None,
    })
}
