//! PTX text to a decoded [`Module`]. Anything outside the documented subset
//! is an error that names the construct and its line (docs/ptx-subset.md).
//!
//! A module decodes into one code array shared by its kernels and
//! functions, a table of functions (frames and entry points) and a table of
//! module variables. Variables live in two device segments (`.global` and
//! `.common` in one, `.const` in the other) placed by [`Module::link`];
//! declarations no instruction or initialiser refers to, that the host
//! cannot name (not `.visible`) and that hold no data of their own (no
//! initialiser), take no space at all.

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::Arc;

use super::exec::{FUNC_WINDOW, LOCAL_WINDOW, PARAM_WINDOW, SHARED_WINDOW};
use super::ir::*;
use super::lex::{self, Statements, Tok, Token};
use super::PtxError;

/// Where a module variable lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VarSpace {
    /// `.global` and `.common`: read-write device memory.
    Global,
    /// `.const`: written by the host, read-only to kernels.
    Const,
}

/// An address stored in a variable's initialiser.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RelocTarget {
    Var(u32),
    Func(u32),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reloc {
    /// Byte offset inside the variable.
    pub at: u64,
    pub target: RelocTarget,
    pub addend: i64,
}

/// A module-scope `.global`, `.const` or `.common` variable.
#[derive(Debug, Clone, PartialEq)]
pub struct Var {
    pub name: String,
    pub space: VarSpace,
    pub size: u64,
    pub align: u64,
    pub visible: bool,
    /// Offset in its segment; None for a declaration nothing uses.
    pub offset: Option<u64>,
    /// Initial bytes (the rest of the variable is zero).
    pub init: Vec<u8>,
    pub relocs: Vec<Reloc>,
}

impl Var {
    /// Kept even where no instruction uses it: the host can name it
    /// (`.visible`), or it carries data of its own (an initialiser), which
    /// libraries read and write through `cuModuleGetGlobal` whatever the
    /// linkage (cuBLAS's internal constants are one).
    fn kept(&self) -> bool {
        self.visible || !self.init.is_empty() || !self.relocs.is_empty()
    }
}

/// A loaded module: its entry points, functions and variables, decoded once.
#[derive(Debug, Clone)]
pub struct Module {
    pub kernels: Vec<Kernel>,
    pub vars: Vec<Var>,
    /// The `.target` architecture as a number (`sm_80` is 80; 0 if absent).
    pub target: u32,
    /// Bytes of the `.global` segment and the `.const` segment.
    pub global_size: u64,
    pub const_size: u64,
    code: Arc<Code>,
}

impl Module {
    pub fn parse(src: &str) -> Result<Module, PtxError> {
        Self::parse_within(src, u64::MAX)
    }

    /// Parses `src` if its transient and retained host memory fit in
    /// `limit` bytes: the tokens of the statement being parsed (the
    /// parser holds one module-scope statement's at a time) and the
    /// decoded form, both measured as they grow.
    pub fn parse_within(src: &str, limit: u64) -> Result<Module, PtxError> {
        Parser::new(src, limit).module()
    }

    /// Host bytes the decoded module keeps, as charged to its tenant.
    pub fn host_bytes(&self) -> u64 {
        let vars: usize = self.vars.iter().map(|v| std::mem::size_of::<Var>() + v.name.capacity() + v.init.capacity() + v.relocs.capacity() * std::mem::size_of::<Reloc>()).sum();
        self.kernels.iter().map(Kernel::host_bytes).sum::<u64>() + self.code.host_bytes() + vars as u64 + std::mem::size_of::<Module>() as u64
    }

    pub fn kernel(&self, name: &str) -> Option<&Kernel> {
        self.kernels.iter().find(|k| k.name == name)
    }

    /// Places the variables: the `.global` segment at `global_base`, the
    /// `.const` segment at `const_base` (each at least [`Module::global_size`]
    /// and [`Module::const_size`] bytes, zeroed). Returns the initialised
    /// bytes to write: (device address, bytes).
    pub fn link(&mut self, global_base: u64, const_base: u64) -> Vec<(u64, Vec<u8>)> {
        let addr = |v: &Var| v.offset.map(|o| o + if v.space == VarSpace::Global { global_base } else { const_base });
        let syms: Vec<u64> = self.vars.iter().map(|v| addr(v).unwrap_or(0)).collect();
        let mut out = Vec::new();
        for v in &self.vars {
            let Some(base) = addr(v) else { continue };
            if v.init.is_empty() && v.relocs.is_empty() {
                continue;
            }
            let mut bytes = v.init.clone();
            for r in &v.relocs {
                let target = match r.target {
                    RelocTarget::Var(i) => syms[i as usize],
                    RelocTarget::Func(i) => FUNC_WINDOW + i as u64,
                };
                let at = r.at as usize;
                if bytes.len() < at + 8 {
                    bytes.resize(at + 8, 0);
                }
                bytes[at..at + 8].copy_from_slice(&target.wrapping_add(r.addend as u64).to_le_bytes());
            }
            bytes.truncate(v.size as usize);
            out.push((base, bytes));
        }
        if syms.iter().any(|s| *s != 0) {
            let mut code = (*self.code).clone();
            code.syms = syms;
            self.code = Arc::new(code);
            for k in &mut self.kernels {
                k.code = self.code.clone();
            }
        }
        out
    }

    /// A linked variable's device address and size, by name.
    pub fn symbol(&self, name: &str) -> Option<(u64, u64)> {
        let i = self.vars.iter().position(|v| v.name == name && v.offset.is_some())?;
        Some((*self.code.syms.get(i)?, self.vars[i].size))
    }

    /// The `.const` segment's linked range, if it has one: kernels may not
    /// store to it.
    pub fn const_range(&self) -> Option<(u64, u64)> {
        let i = self.vars.iter().position(|v| v.space == VarSpace::Const && v.offset.is_some())?;
        let base = self.code.syms.get(i)? - self.vars[i].offset?;
        (self.const_size > 0 && base != 0).then_some((base, self.const_size))
    }

    /// The parameter layout of every `.entry`, without decoding bodies:
    /// what a GPU backend needs to lay out launch parameters for PTX the
    /// interpreter itself may not support.
    pub fn signatures(src: &str, limit: u64) -> Result<Vec<Signature>, PtxError> {
        let mut p = Parser::new(src, limit);
        let mut out = Vec::new();
        while p.more()? {
            let entry = matches!(p.t[p.i].tok, Tok::Word(".entry"));
            p.i += 1;
            if entry {
                let name = p.word()?.to_string();
                let (params, params_size) = if p.is_punct('(') { p.params()? } else { (Vec::new(), 0) };
                // What is returned is charged as it grows (its vector's
                // slack included): a module of bare `.entry a;` lines
                // makes more of it than its tokens.
                let names: usize = params.iter().map(|p| std::mem::size_of::<Param>() + p.name.capacity()).sum();
                p.charge((2 * std::mem::size_of::<Signature>() + name.capacity() + names) as u64)?;
                out.push(Signature { name, params, params_size });
            }
        }
        Ok(out)
    }

    /// Device memory a GPU's driver places for this module's variables,
    /// without decoding bodies: the sizes of its `.global` and `.const`
    /// definitions (`.extern` declarations place nothing), each at its
    /// alignment (natural, unless it gives one). Types the interpreter does not know count 16
    /// bytes an element, the widest PTX has; an unsized array counts the
    /// elements of its initialiser.
    pub fn placed_bytes(src: &str, limit: u64) -> Result<u64, PtxError> {
        let mut p = Parser::new(src, limit);
        let (mut external, mut total) = (false, 0u64);
        while p.more()? {
            // In a parameter, `.ptr .global` is an attribute, not a variable.
            let after_ptr = p.i > 0 && matches!(p.t[p.i - 1].tok, Tok::Word(".ptr"));
            match p.t[p.i].tok {
                Tok::Punct(';' | '{' | '}') => external = false,
                Tok::Word(".extern") => external = true,
                Tok::Word(w) if !after_ptr && (w == ".global" || w == ".const") => {
                    p.i += 1;
                    for (size, align) in p.placed_decl()? {
                        if !external {
                            total = total.checked_next_multiple_of(align.max(1)).unwrap_or(u64::MAX).saturating_add(size);
                        }
                    }
                    external = false;
                    continue;
                }
                _ => {}
            }
            p.i += 1;
        }
        Ok(total)
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
/// Largest local frame of one function or kernel (CUDA's per-thread limit).
pub const MAX_FRAME: u32 = 512 * 1024;
/// Largest module variable, and largest segment.
const MAX_SEGMENT: u64 = 1 << 36;
/// Most call arguments and branch-table entries.
const MAX_LIST: usize = 4096;

#[derive(Debug, Clone, Copy)]
enum SharedVar {
    Static(u32),
    /// `.extern .shared` arrays: the start of dynamic shared memory.
    Dynamic,
}

struct Parser<'a> {
    /// The tokens of the module-scope statement being parsed (and of any
    /// whole statements before it in the same window), and the next one.
    t: Vec<Token<'a>>,
    i: usize,
    stmts: Statements<'a>,
    module_shared: HashMap<String, SharedVar>,
    module_shared_bytes: u32,
    vars: Vec<Var>,
    var_names: HashMap<String, u32>,
    used: Vec<Cell<bool>>,
    funcs: Vec<Func>,
    func_names: HashMap<String, u32>,
    called: Vec<Cell<bool>>,
    code: Vec<Inst>,
    /// Host bytes the decoded module may take, and what it takes so far.
    limit: u64,
    decoded: u64,
    target: u32,
}

/// Operand as written, before it is resolved against a body's names.
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

struct Body {
    regs: HashMap<String, (u32, Ty)>,
    /// `.reg .t %r<N>` ranges: prefix to (first slot, count, type).
    reg_ranges: HashMap<String, (u32, u32, Ty)>,
    num_regs: u32,
    shared: HashMap<String, SharedVar>,
    shared_bytes: u32,
    /// Kernel parameters (empty in a function), and their offsets by name.
    params: Vec<Param>,
    param_offsets: HashMap<String, u32>,
    /// Frame variables (`.local`, body `.param`, function parameters):
    /// offset in the frame and size.
    locals: HashMap<String, (u32, u32)>,
    local_top: u32,
    local_max: u32,
    scopes: Vec<u32>,
    /// Register names declared in each open `{ }` scope, with what they
    /// shadowed, restored when the scope closes.
    reg_scopes: Vec<Vec<Shadowed>>,
    labels: HashMap<String, u32>,
    tables: HashMap<String, Vec<String>>,
    fixups: Vec<(usize, String, u32)>,
    brx_fixups: Vec<(usize, String, u32)>,
    start: usize,
}

/// A register name declared in a nested scope and what it hid: its slot
/// and type outside the scope, if it had one.
type Shadowed = (String, Option<(u32, Ty)>);

fn align_up(v: u32, a: u32) -> Option<u32> {
    if a <= 1 {
        Some(v)
    } else {
        v.div_ceil(a).checked_mul(a)
    }
}

impl Body {
    fn new(start: usize, shared_bytes: u32) -> Body {
        Body {
            regs: HashMap::new(),
            reg_ranges: HashMap::new(),
            // Slot 0 is the carry flag of `add.cc` and friends.
            num_regs: 1,
            shared: HashMap::new(),
            shared_bytes,
            params: Vec::new(),
            param_offsets: HashMap::new(),
            locals: HashMap::new(),
            local_top: 0,
            local_max: 0,
            scopes: Vec::new(),
            reg_scopes: Vec::new(),
            labels: HashMap::new(),
            tables: HashMap::new(),
            fixups: Vec::new(),
            brx_fixups: Vec::new(),
            start,
        }
    }

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

    /// Reserves `size` bytes aligned to `align` in the frame.
    fn local(&mut self, name: String, size: u64, align: u32, line: u32) -> Result<u32, PtxError> {
        let off = align_up(self.local_top, align).ok_or_else(|| PtxError::at(line, "local frame overflow"))?;
        let end = (off as u64).saturating_add(size);
        if end > MAX_FRAME as u64 {
            return Err(PtxError::at(line, format!("local frame of more than {MAX_FRAME} bytes")));
        }
        self.local_top = end as u32;
        self.local_max = self.local_max.max(self.local_top);
        self.locals.insert(name, (off, size as u32));
        Ok(off)
    }
}

/// A variable's declaration, before it is placed.
struct Decl {
    name: String,
    ty: Ty,
    vec: u32,
    size: u64,
    align: u32,
    /// `[]`: an unsized (dynamic) array.
    unsized_: bool,
}

impl<'a> Parser<'a> {
    fn new(src: &'a str, limit: u64) -> Parser<'a> {
        Parser {
            t: Vec::new(),
            i: 0,
            stmts: Statements::new(src),
            module_shared: HashMap::new(),
            module_shared_bytes: 0,
            vars: Vec::new(),
            var_names: HashMap::new(),
            used: Vec::new(),
            funcs: Vec::new(),
            func_names: HashMap::new(),
            called: Vec::new(),
            code: Vec::new(),
            limit,
            decoded: 0,
            target: 0,
        }
    }

    fn line(&self) -> u32 {
        self.t.get(self.i).or(self.t.last()).map(|t| t.line).unwrap_or(0)
    }

    fn err<T>(&self, msg: impl Into<String>) -> Result<T, PtxError> {
        Err(PtxError::at(self.line(), msg))
    }

    fn peek(&self) -> Option<Tok<'a>> {
        self.t.get(self.i).map(|t| t.tok)
    }

    /// Host bytes the token window holds.
    fn held(&self) -> u64 {
        (self.t.capacity() as u64).saturating_mul(lex::TOKEN_BYTES)
    }

    /// Host bytes of the instruction array, its unused capacity included
    /// (the rest of the decoded form is in `decoded`).
    fn code_bytes(&self) -> u64 {
        (self.code.capacity() as u64).saturating_mul(std::mem::size_of::<Inst>() as u64)
    }

    /// Whether the decoded form, the instruction array and the token
    /// window together are past the limit.
    fn over_limit(&self) -> bool {
        self.decoded.saturating_add(self.code_bytes()).saturating_add(self.held()) > self.limit
    }

    /// Whether tokens are left: when the window is used up, it takes the
    /// next module-scope statement's, within what the decoded module
    /// leaves of the budget.
    fn more(&mut self) -> Result<bool, PtxError> {
        if self.i < self.t.len() {
            return Ok(true);
        }
        let room = self.limit.saturating_sub(self.decoded).saturating_sub(self.code_bytes()) / lex::TOKEN_BYTES;
        let room = usize::try_from(room).unwrap_or(usize::MAX);
        self.t.clear();
        if self.t.capacity() > room {
            self.t.shrink_to(room);
        }
        self.i = 0;
        match self.stmts.next_into(&mut self.t, room) {
            Ok(any) => Ok(any),
            Err(Some(e)) => Err(e),
            Err(None) => Err(PtxError::over_budget(
                self.stmts.line(),
                format!(
                    "the tokens of one statement of this module need more than the {} bytes of host memory the tenant's host budget leaves beside its decoded part ({} bytes)",
                    room as u64 * lex::TOKEN_BYTES,
                    self.decoded
                ),
            )),
        }
    }

    fn peek_word(&self) -> Option<&'a str> {
        match self.peek() {
            Some(Tok::Word(w)) => Some(w),
            _ => None,
        }
    }

    fn next(&mut self) -> Result<Tok<'a>, PtxError> {
        let t = self.peek();
        match t {
            Some(t) => {
                self.i += 1;
                Ok(t)
            }
            None => self.err("unexpected end of module"),
        }
    }

    fn is_punct(&self, c: char) -> bool {
        self.peek() == Some(Tok::Punct(c))
    }

    fn expect_punct(&mut self, c: char) -> Result<(), PtxError> {
        match self.next()? {
            Tok::Punct(x) if x == c => Ok(()),
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
            Tok::Int(v) => Ok(v),
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

    fn charge(&mut self, bytes: u64) -> Result<(), PtxError> {
        self.decoded = self.decoded.saturating_add(bytes);
        if self.over_limit() {
            return Err(PtxError::over_budget(self.line(), format!("the decoded module needs more than {} bytes of host memory, the rest of the tenant's host budget", self.limit)));
        }
        Ok(())
    }

    fn module(&mut self) -> Result<Module, PtxError> {
        let mut kernels = Vec::new();
        while self.more()? {
            let t = self.t[self.i].tok;
            let Tok::Word(w) = t else {
                return self.err(format!("unexpected {} at module scope", show(t)));
            };
            match w {
                ".version" | ".file" | ".loc" => self.skip_line(),
                ".target" => {
                    self.i += 1;
                    let line = self.line();
                    while self.i < self.t.len() && self.t[self.i].line == line {
                        if let Tok::Word(w) = &self.t[self.i].tok {
                            if let Some(n) = w.strip_prefix("sm_") {
                                let digits: String = n.chars().take_while(|c| c.is_ascii_digit()).collect();
                                self.target = digits.parse().unwrap_or(0);
                            }
                        }
                        self.i += 1;
                    }
                }
                ".address_size" => {
                    self.i += 1;
                    let n = self.int()?;
                    if n != 64 {
                        return self.err(format!(".address_size {n} is unsupported: only 64-bit addressing"));
                    }
                }
                ".visible" | ".extern" | ".weak" | ".common" | ".entry" | ".func" | ".global" | ".const" | ".shared" => self.declaration()?.map(|k| kernels.push(k)).unwrap_or(()),
                ".local" | ".tex" | ".surf" | ".sampler" | ".texref" | ".surfref" | ".samplerref" => {
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
        self.finish(kernels)
    }

    /// One module-scope declaration after its linkage directives.
    fn declaration(&mut self) -> Result<Option<Kernel>, PtxError> {
        let (mut visible, mut external, mut common) = (false, false, false);
        loop {
            match self.word()? {
                ".visible" | ".weak" => visible = true,
                ".extern" => external = true,
                ".common" => {
                    common = true;
                    visible = true;
                }
                ".entry" => return self.entry().map(Some),
                ".func" => return self.func(external).map(|_| None),
                ".shared" => {
                    let line = self.line();
                    let d = self.var_decl()?;
                    if self.is_punct('=') {
                        return self.err(format!("shared variable '{}' cannot have an initialiser", d.name));
                    }
                    self.expect_punct(';')?;
                    if d.unsized_ || (external && d.size == 0) {
                        self.module_shared.insert(d.name, SharedVar::Dynamic);
                    } else {
                        let offset = align_up(self.module_shared_bytes, d.align).ok_or_else(|| PtxError::at(line, "shared memory overflow"))?;
                        let size = u32::try_from(d.size).map_err(|_| PtxError::at(line, "shared variable too large"))?;
                        self.module_shared_bytes = offset.checked_add(size).ok_or_else(|| PtxError::at(line, "shared memory overflow"))?;
                        self.module_shared.insert(d.name, SharedVar::Static(offset));
                    }
                    return Ok(None);
                }
                w @ (".global" | ".const") => {
                    let space = if w == ".global" { VarSpace::Global } else { VarSpace::Const };
                    self.module_var(space, visible || common, external)?;
                    return Ok(None);
                }
                w => return self.err(format!("unsupported module-scope declaration '{w}'")),
            }
        }
    }

    /// `[.align N] [.vN] .type name [dims]*` after a state-space directive.
    fn var_decl(&mut self) -> Result<Decl, PtxError> {
        let mut align = 0u32;
        let mut vec = 1u32;
        let mut ty = None;
        loop {
            let w = self.word()?;
            match w {
                ".align" => align = self.align()?,
                ".v2" => vec = 2,
                ".v4" => vec = 4,
                ".v8" => vec = 8,
                ".attribute" => return self.err("variable attributes (.managed, .unified) are unsupported on the CPU reference device"),
                ".ptr" => {}
                _ if w.starts_with('.') => match Ty::parse(&w[1..]) {
                    Some(t) => ty = Some(t),
                    None => return self.err(format!("unsupported variable type '{w}'")),
                },
                name => {
                    let ty = ty.ok_or_else(|| PtxError::at(self.line(), format!("variable '{name}' has no type")))?;
                    let mut size = (ty.bytes() as u64) * vec as u64;
                    let mut unsized_ = false;
                    while self.is_punct('[') {
                        self.i += 1;
                        if self.is_punct(']') {
                            unsized_ = true;
                            size = 0;
                        } else {
                            size = size.saturating_mul(self.int()?);
                        }
                        self.expect_punct(']')?;
                    }
                    if size > MAX_SEGMENT {
                        return self.err(format!("variable '{name}' of {size} bytes is too large"));
                    }
                    let align = if align == 0 { ty.bytes() as u32 * vec } else { align };
                    return Ok(Decl { name: name.to_string(), ty, vec, size, align: align.max(1), unsized_ });
                }
            }
        }
    }

    /// The size and alignment of each variable declared after `.global` or
    /// `.const` (`.b8 a[4], b<8>;` declares nine), leniently
    /// ([`Module::placed_bytes`]); consumes the declaration through its
    /// `;`. Anything it does not understand after a name is an error, so
    /// nothing is left uncounted.
    fn placed_decl(&mut self) -> Result<Vec<(u64, u64)>, PtxError> {
        let (mut align, mut vec, mut elem) = (None, 1u64, 16u64);
        let mut out = Vec::new();
        loop {
            match self.next()? {
                Tok::Word(".align") => align = Some(self.int()?.clamp(1, MAX_ALIGN)),
                Tok::Word(".v2") => vec = 2,
                Tok::Word(".v4") => vec = 4,
                Tok::Word(".v8") => vec = 8,
                Tok::Word(w) if w.starts_with('.') => {
                    if let Some(t) = Ty::parse(&w[1..]) {
                        elem = t.bytes() as u64;
                    }
                }
                // `.attribute(.managed)` and the like, nested or not.
                Tok::Punct('(') => {
                    let mut depth = 1u32;
                    while depth > 0 {
                        match self.next()? {
                            Tok::Punct('(') => depth += 1,
                            Tok::Punct(')') => depth -= 1,
                            _ => {}
                        }
                    }
                }
                Tok::Word(_) => {
                    let one = elem.saturating_mul(vec);
                    // Naturally aligned unless it says otherwise.
                    let align = align.unwrap_or(one);
                    loop {
                        let (mut count, mut unsized_) = (1u64, false);
                        while self.is_punct('[') {
                            self.i += 1;
                            if self.is_punct(']') {
                                unsized_ = true;
                            } else {
                                count = count.saturating_mul(self.int()?);
                            }
                            self.expect_punct(']')?;
                        }
                        // `name<N>`: N variables name0 .. name(N-1).
                        if self.is_punct('<') {
                            self.i += 1;
                            count = count.saturating_mul(self.int()?);
                            self.expect_punct('>')?;
                        }
                        let mut elements = 0u64;
                        if self.is_punct('=') {
                            self.i += 1;
                            let mut depth = 0u32;
                            loop {
                                match self.peek() {
                                    Some(Tok::Punct('{')) => depth += 1,
                                    Some(Tok::Punct('}')) => depth = depth.saturating_sub(1),
                                    Some(Tok::Punct(',' | ';')) if depth == 0 => break,
                                    Some(Tok::Punct(_)) => {}
                                    Some(_) => elements += 1,
                                    None => return self.err("unexpected end of module in an initialiser"),
                                }
                                self.i += 1;
                            }
                        }
                        if unsized_ {
                            count = elements;
                        }
                        out.push((one.saturating_mul(count), align));
                        match self.next()? {
                            Tok::Punct(';') => return Ok(out),
                            Tok::Punct(',') => {}
                            other => return self.err(format!("expected ',' or ';' after a variable, found {}", show(other))),
                        }
                        match self.next()? {
                            Tok::Word(_) => {}
                            other => return self.err(format!("expected a variable name, found {}", show(other))),
                        }
                    }
                }
                other => return self.err(format!("expected a variable declaration, found {}", show(other))),
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

    fn module_var(&mut self, space: VarSpace, visible: bool, external: bool) -> Result<(), PtxError> {
        let line = self.line();
        let d = self.var_decl()?;
        let mut var = Var { name: d.name.clone(), space, size: d.size, align: d.align as u64, visible, offset: None, init: Vec::new(), relocs: Vec::new() };
        if self.is_punct('=') {
            self.i += 1;
            self.initialiser(&d, &mut var)?;
        }
        self.expect_punct(';')?;
        if external && d.size == 0 {
            return Err(PtxError::at(line, format!("external variable '{}' is not defined in this module", d.name)));
        }
        self.charge((std::mem::size_of::<Var>() + var.name.len() + var.init.len() + var.relocs.len() * std::mem::size_of::<Reloc>()) as u64)?;
        if let Some(&i) = self.var_names.get(&d.name) {
            // A later definition of a declared variable replaces it.
            self.vars[i as usize] = var;
        } else {
            self.var_names.insert(d.name, self.vars.len() as u32);
            self.vars.push(var);
            self.used.push(Cell::new(false));
        }
        Ok(())
    }

    /// `= value` or `= { ... }` (nested for arrays): element bytes in
    /// order, addresses of variables and functions as relocations.
    fn initialiser(&mut self, d: &Decl, var: &mut Var) -> Result<(), PtxError> {
        let elem = d.ty.bytes() as u64;
        let cap = d.size.max(elem * d.vec as u64);
        let mut depth = 0u32;
        loop {
            match self.peek() {
                Some(Tok::Punct('{')) => {
                    depth += 1;
                    if depth > 8 {
                        return self.err("initialiser nested too deeply");
                    }
                    self.i += 1;
                    continue;
                }
                Some(Tok::Punct('}')) => {
                    self.i += 1;
                    depth = depth.saturating_sub(1);
                }
                Some(Tok::Punct(',')) => {
                    self.i += 1;
                    continue;
                }
                Some(Tok::Punct(';')) if depth == 0 => return Ok(()),
                Some(_) => {
                    let at = (var.init.len() as u64).max(var.relocs.last().map(|r| r.at + 8).unwrap_or(0));
                    if at + elem > cap {
                        return self.err(format!("initialiser of '{}' has more elements than the variable", d.name));
                    }
                    self.init_element(d.ty, at, var)?;
                }
                None => return self.err("unexpected end of module in an initialiser"),
            }
            if depth == 0 {
                return Ok(());
            }
        }
    }

    fn init_element(&mut self, ty: Ty, at: u64, var: &mut Var) -> Result<(), PtxError> {
        let n = ty.bytes();
        let neg = if self.is_punct('-') {
            self.i += 1;
            true
        } else {
            false
        };
        let bits: u64 = match self.next()? {
            Tok::Int(mag) => {
                let f = if neg { -(mag as f64) } else { mag as f64 };
                match ty {
                    Ty::F32 => (f as f32).to_bits() as u64,
                    Ty::F64 => f.to_bits(),
                    _ if neg => mag.wrapping_neg(),
                    _ => mag,
                }
            }
            Tok::F32(b) => {
                let b = if neg { b ^ 0x8000_0000 } else { b };
                if ty == Ty::F64 {
                    (f32::from_bits(b) as f64).to_bits()
                } else {
                    b as u64
                }
            }
            Tok::F64(b) => {
                let b = if neg { b ^ (1 << 63) } else { b };
                if ty == Ty::F32 {
                    (f64::from_bits(b) as f32).to_bits() as u64
                } else {
                    b
                }
            }
            Tok::Word(w) => {
                // `sym`, `generic(sym)`, `sym + k`: an address, 64-bit only.
                let mut name = w;
                let mut paren = false;
                if (name == "generic" || name == "mask") && self.is_punct('(') {
                    if name == "mask" {
                        return self.err("mask() initialisers are unsupported");
                    }
                    self.i += 1;
                    name = self.word()?;
                    paren = true;
                }
                let mut addend = 0i64;
                if paren {
                    self.expect_punct(')')?;
                }
                if self.is_punct('+') || self.is_punct('-') {
                    let minus = self.is_punct('-');
                    self.i += 1;
                    let k = i64::try_from(self.int()?).map_err(|_| PtxError::at(self.line(), "initialiser offset out of range"))?;
                    addend = if minus { -k } else { k };
                }
                if n != 8 {
                    return self.err(format!("address of '{name}' in a {}-byte initialiser element", n));
                }
                let target = if let Some(&v) = self.var_names.get(name) {
                    self.used[v as usize].set(true);
                    RelocTarget::Var(v)
                } else if let Some(&f) = self.func_names.get(name) {
                    RelocTarget::Func(f)
                } else {
                    return self.err(format!("unknown symbol '{name}' in an initialiser"));
                };
                if var.relocs.len() >= MAX_LIST * 16 {
                    return self.err("too many addresses in an initialiser");
                }
                var.init.resize(at as usize, 0);
                var.relocs.push(Reloc { at, target, addend });
                var.init.extend_from_slice(&[0; 8]);
                return Ok(());
            }
            other => return self.err(format!("bad initialiser element {}", show(other))),
        };
        var.init.resize(at as usize, 0);
        var.init.extend_from_slice(&bits.to_le_bytes()[..n]);
        Ok(())
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
                size = size.saturating_mul(u32::try_from(self.int()?).unwrap_or(u32::MAX));
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

    /// A function's parameter list `( .param ... , ... )`, laid out in its
    /// frame.
    fn func_params(&mut self, b: &mut Body) -> Result<Vec<(u32, u32)>, PtxError> {
        let mut out = Vec::new();
        self.expect_punct('(')?;
        while !self.is_punct(')') {
            let line = self.line();
            match self.word()? {
                ".param" => {}
                ".reg" => return self.err("register parameters are unsupported: only the .param calling convention"),
                other => return self.err(format!("expected .param in a function signature, found '{other}'")),
            }
            let d = self.var_decl()?;
            let off = b.local(d.name, d.size, d.align, line)?;
            if out.len() >= MAX_LIST {
                return self.err("too many parameters");
            }
            out.push((off, d.size as u32));
            if self.is_punct(',') {
                self.i += 1;
            }
        }
        self.expect_punct(')')?;
        Ok(out)
    }

    fn func_index(&mut self, name: &str, line: u32) -> u32 {
        if let Some(&f) = self.func_names.get(name) {
            return f;
        }
        let builtin = match name {
            "__assertfail" => Some(Builtin::AssertFail),
            "vprintf" => Some(Builtin::Vprintf),
            _ => None,
        };
        let i = self.funcs.len() as u32;
        self.funcs.push(Func { name: name.to_string(), entry: None, builtin, num_regs: 1, local_size: 0, params: Vec::new(), ret: None, line });
        self.called.push(Cell::new(false));
        self.func_names.insert(name.to_string(), i);
        i
    }

    /// `.func [(ret)] name [(params)] [attrs] (; | { body })`.
    fn func(&mut self, _external: bool) -> Result<(), PtxError> {
        let line = self.line();
        let mut b = Body::new(self.code.len(), self.module_shared_bytes);
        let ret = if self.is_punct('(') {
            let r = self.func_params(&mut b)?;
            if r.len() > 1 {
                return self.err("functions return at most one value");
            }
            r.first().copied()
        } else {
            None
        };
        let name = self.word()?.to_string();
        let params = if self.is_punct('(') { self.func_params(&mut b)? } else { Vec::new() };
        let f = self.func_index(&name, line);
        {
            // A prototype after the definition does not change its layout.
            let func = &mut self.funcs[f as usize];
            if func.entry.is_none() {
                func.params = params;
                func.ret = ret;
            }
        }
        while !self.is_punct('{') {
            if let Tok::Punct(';') = self.next()? {
                return Ok(());
            }
        }
        if self.funcs[f as usize].entry.is_some() {
            return self.err(format!("function '{name}' is defined twice"));
        }
        self.i += 1;
        let entry = self.code.len() as u32;
        self.body(&mut b, false)?;
        let func = &mut self.funcs[f as usize];
        func.entry = Some(entry);
        func.builtin = None;
        func.num_regs = b.num_regs;
        func.local_size = b.local_max;
        Ok(())
    }

    fn entry(&mut self) -> Result<Kernel, PtxError> {
        let name = self.word()?.to_string();
        let (params, params_size) = if self.is_punct('(') { self.params()? } else { (Vec::new(), 0) };
        // Performance directives (.maxntid, .reqntid, ...) up to the body.
        while !self.is_punct('{') {
            match self.next()? {
                Tok::Punct(';') => return self.err(format!("kernel '{name}' has no body")),
                Tok::Word(".reqnctapercluster") => {
                    let mut n = 1u64;
                    while let Some(Tok::Int(v)) = self.peek() {
                        n = n.saturating_mul(v);
                        self.i += 1;
                        if self.is_punct(',') {
                            self.i += 1;
                        }
                    }
                    if n > 1 {
                        return self.err(format!("kernel '{name}': thread-block clusters of more than one CTA (.reqnctapercluster, {n} CTAs) are unsupported on the CPU reference device"));
                    }
                }
                _ => {}
            }
        }
        self.i += 1;
        let entry = self.code.len() as u32;
        let mut b = Body::new(self.code.len(), self.module_shared_bytes);
        b.param_offsets = params.iter().map(|p| (p.name.clone(), p.offset)).collect();
        b.params = params;
        self.body(&mut b, true)?;
        let k = Kernel { name, params: std::mem::take(&mut b.params), params_size, entry, num_regs: b.num_regs, local_size: b.local_max, shared_bytes: b.shared_bytes, code: Arc::default() };
        self.charge(k.host_bytes())?;
        Ok(k)
    }

    fn body(&mut self, b: &mut Body, kernel: bool) -> Result<(), PtxError> {
        let mut depth = 1;
        while depth > 0 {
            if self.code.len() % 1024 == 1023 && self.over_limit() {
                return Err(PtxError::over_budget(self.line(), format!("the decoded module needs more than {} bytes of host memory, the rest of the tenant's host budget", self.limit)));
            }
            let line = self.line();
            match self.next()? {
                Tok::Punct('{') => {
                    depth += 1;
                    b.scopes.push(b.local_top);
                    b.reg_scopes.push(Vec::new());
                }
                Tok::Punct('}') => {
                    depth -= 1;
                    // A scope's `.param` variables are dead after it.
                    if let Some(top) = b.scopes.pop() {
                        b.local_top = top;
                    }
                    for (name, prev) in b.reg_scopes.pop().unwrap_or_default().into_iter().rev() {
                        match prev {
                            Some(r) => b.regs.insert(name, r),
                            None => b.regs.remove(&name),
                        };
                    }
                }
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
                    self.instruction(b, opw, Some((slot, neg)), line)?;
                }
                Tok::Word(w) => match w {
                    ".reg" => self.reg_decl(b)?,
                    ".shared" => {
                        if !kernel {
                            return Err(PtxError::at(line, "'.shared' variables inside a function are unsupported"));
                        }
                        let d = self.var_decl()?;
                        self.expect_punct(';')?;
                        if d.unsized_ {
                            b.shared.insert(d.name, SharedVar::Dynamic);
                        } else {
                            let offset = align_up(b.shared_bytes, d.align).ok_or_else(|| PtxError::at(line, "shared memory overflow"))?;
                            let size = u32::try_from(d.size).map_err(|_| PtxError::at(line, "shared variable too large"))?;
                            b.shared_bytes = offset.checked_add(size).ok_or_else(|| PtxError::at(line, "shared memory overflow"))?;
                            b.shared.insert(d.name, SharedVar::Static(offset));
                        }
                    }
                    ".local" | ".param" => {
                        let d = self.var_decl()?;
                        if self.is_punct('=') {
                            return Err(PtxError::at(line, format!("initialised {w} variable '{}' is unsupported", d.name)));
                        }
                        self.expect_punct(';')?;
                        b.local(d.name, d.size, d.align, line)?;
                    }
                    ".pragma" => self.skip_to_semicolon()?,
                    ".loc" | ".file" => {
                        self.i -= 1;
                        self.skip_line();
                    }
                    d if d.starts_with('.') => return Err(PtxError::at(line, format!("unsupported directive '{d}' in a function body"))),
                    label if self.is_punct(':') => {
                        self.i += 1;
                        match self.peek_word() {
                            Some(".branchtargets") => {
                                self.i += 1;
                                let mut targets = Vec::new();
                                loop {
                                    targets.push(self.word()?.to_string());
                                    if targets.len() > MAX_LIST {
                                        return self.err("branch table too long");
                                    }
                                    match self.next()? {
                                        Tok::Punct(',') => continue,
                                        Tok::Punct(';') => break,
                                        other => return self.err(format!("expected ',' or ';' in .branchtargets, found {}", show(other))),
                                    }
                                }
                                b.tables.insert(label.to_string(), targets);
                            }
                            Some(".callprototype") => self.skip_to_semicolon()?,
                            _ => {
                                b.labels.insert(label.to_string(), (self.code.len() - b.start) as u32);
                            }
                        }
                    }
                    opw => self.instruction(b, opw, None, line)?,
                },
                other => return Err(PtxError::at(line, format!("unexpected {}", show(other)))),
            }
        }
        let start = b.start as u32;
        for (idx, label, line) in std::mem::take(&mut b.fixups) {
            let target = *b.labels.get(&label).ok_or_else(|| PtxError::at(line, format!("unknown label '{label}'")))?;
            if let Op::Bra { target: t } = &mut self.code[idx].op {
                *t = start + target;
            }
        }
        // Each table is resolved once, however many brx.idx use it.
        let mut resolved: HashMap<String, Vec<u32>> = HashMap::new();
        for (idx, table, line) in std::mem::take(&mut b.brx_fixups) {
            if !resolved.contains_key(&table) {
                let names = b.tables.get(&table).ok_or_else(|| PtxError::at(line, format!("unknown branch table '{table}'")))?;
                let mut ts = Vec::with_capacity(names.len());
                for n in names {
                    ts.push(start + *b.labels.get(n).ok_or_else(|| PtxError::at(line, format!("unknown label '{n}' in branch table")))?);
                }
                resolved.insert(table.clone(), ts);
            }
            let ts = resolved[&table].clone();
            self.charge(ts.len() as u64 * 4)?;
            if let Op::Brx { targets, .. } = &mut self.code[idx].op {
                *targets = ts;
            }
        }
        // Falling off the end returns (a kernel's thread exits).
        self.code.push(Inst { guard: None, op: Op::Ret, line: self.line() });
        self.charge(std::mem::size_of::<Inst>() as u64)?;
        Ok(())
    }

    fn reg_decl(&mut self, b: &mut Body) -> Result<(), PtxError> {
        let mut tw = self.word()?;
        if matches!(tw, ".v2" | ".v4") {
            tw = self.word()?;
        }
        let ty = tw.strip_prefix('.').and_then(Ty::parse).ok_or_else(|| PtxError::at(self.line(), format!("unsupported register type '{tw}'")))?;
        loop {
            let name = self.word()?.to_string();
            let count = if self.is_punct('<') {
                self.i += 1;
                let n = self.int()?;
                self.expect_punct('>')?;
                if n > 1 << 18 {
                    return self.err(format!("too many registers in '{name}<{n}>'"));
                }
                Some(n as u32)
            } else {
                None
            };
            let n = count.unwrap_or(1);
            if b.num_regs.saturating_add(n) > (1 << 18) + 1 {
                return self.err("too many registers");
            }
            match count {
                Some(n) => {
                    b.reg_ranges.insert(name, (b.num_regs, n, ty));
                }
                None => {
                    let prev = b.regs.insert(name.clone(), (b.num_regs, ty));
                    if let Some(scope) = b.reg_scopes.last_mut() {
                        scope.push((name, prev));
                    }
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
                    Tok::Int(v) => Raw::Int(v as i128),
                    other => return self.err(format!("bad address base {}", show(other))),
                };
                let mut off = 0i64;
                while self.is_punct('+') || self.is_punct('-') {
                    let mut neg = self.is_punct('-');
                    self.i += 1;
                    if self.is_punct('-') {
                        neg = !neg;
                        self.i += 1;
                    }
                    let v = self.int()?;
                    let v = i64::try_from(v).map_err(|_| PtxError::at(self.line(), "address offset out of range"))?;
                    off = off.wrapping_add(if neg { -v } else { v });
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
                Tok::Int(v) => Raw::Int(-(v as i128)),
                Tok::F32(b) => Raw::F32(b ^ 0x8000_0000),
                Tok::F64(b) => Raw::F64(b ^ (1 << 63)),
                other => return self.err(format!("bad negative operand {}", show(other))),
            },
            Tok::Int(v) => Raw::Int(v as i128),
            Tok::F32(b) => Raw::F32(b),
            Tok::F64(b) => Raw::F64(b),
            Tok::Word("_") => Raw::Sink,
            Tok::Word(w) => {
                // `sym+8` as a plain operand (an address constant).
                let name = Raw::Name(w.to_string());
                if (self.is_punct('+') || self.is_punct('-')) && matches!(self.t.get(self.i + 1).map(|t| &t.tok), Some(Tok::Int(_))) {
                    let neg = self.is_punct('-');
                    self.i += 1;
                    let v = i64::try_from(self.int()?).map_err(|_| PtxError::at(self.line(), "offset out of range"))?;
                    Raw::Addr(Box::new(name), if neg { -v } else { v })
                } else {
                    name
                }
            }
            other => return self.err(format!("bad operand {}", show(other))),
        };
        if self.is_punct('|') {
            self.i += 1;
            let second = self.operand_at(depth + 1)?;
            return Ok(Raw::Pair(Box::new(first), Box::new(second)));
        }
        Ok(first)
    }

    /// `call{.uni} [(ret),] target, [(args)] [, proto];`
    fn call(&mut self, b: &mut Body, guard: Option<(u32, bool)>, line: u32) -> Result<(), PtxError> {
        let list = |p: &mut Self| -> Result<Vec<String>, PtxError> {
            p.expect_punct('(')?;
            let mut v = Vec::new();
            while !p.is_punct(')') {
                v.push(p.word()?.to_string());
                if v.len() > MAX_LIST {
                    return p.err("too many call arguments");
                }
                if p.is_punct(',') {
                    p.i += 1;
                }
            }
            p.i += 1;
            Ok(v)
        };
        let ret = if self.is_punct('(') {
            let r = list(self)?;
            self.expect_punct(',')?;
            r
        } else {
            Vec::new()
        };
        let target = self.word()?.to_string();
        let args = if self.is_punct(',') {
            self.i += 1;
            if self.is_punct('(') {
                list(self)?
            } else {
                Vec::new()
            }
        } else {
            Vec::new()
        };
        // An optional prototype or target list.
        if self.is_punct(',') {
            self.i += 1;
            self.word()?;
        }
        self.expect_punct(';')?;
        let var = |n: &String| -> Result<(u32, u32), PtxError> {
            match b.locals.get(n) {
                Some(&var) => Ok(var),
                None => Err(PtxError::at(line, format!("call argument '{n}' is not a .param variable"))),
            }
        };
        let args = args.iter().map(var).collect::<Result<Vec<_>, _>>()?;
        if ret.len() > 1 {
            return Err(PtxError::at(line, "a call returns at most one value"));
        }
        let ret = ret.first().map(var).transpose()?;
        let callee = if let Some((slot, _)) = b.reg(&target) {
            Callee::Indirect(Src::Reg(slot))
        } else {
            let f = self.func_index(&target, line);
            self.called[f as usize].set(true);
            Callee::Direct(f)
        };
        self.charge(args.len() as u64 * 8)?;
        self.code.push(Inst { guard, op: Op::Call { callee, args, ret }, line });
        Ok(())
    }

    fn instruction(&mut self, b: &mut Body, opw: &'a str, guard: Option<(u32, bool)>, line: u32) -> Result<(), PtxError> {
        let base = opw.split('.').next().unwrap_or("");
        if base == "call" {
            return self.call(b, guard, line);
        }
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
        let cx = Cx { b, p: self, line, opw };
        let (op, label) = cx.decode(&ops)?;
        match label {
            Some(Label::Bra(l)) => b.fixups.push((self.code.len(), l, line)),
            Some(Label::Table(t)) => b.brx_fixups.push((self.code.len(), t, line)),
            None => {}
        }
        self.code.push(Inst { guard, op, line });
        Ok(())
    }

    /// Places used variables, checks calls, and shares the code.
    fn finish(&mut self, mut kernels: Vec<Kernel>) -> Result<Module, PtxError> {
        for (f, called) in self.funcs.iter().zip(&self.called) {
            if called.get() && f.entry.is_none() && f.builtin.is_none() {
                return Err(PtxError::at(f.line, format!("call to external function '{}', which this device does not provide", f.name)));
            }
        }
        // Initialisers can make more variables used; settle that first.
        let mut changed = true;
        while changed {
            changed = false;
            for (i, v) in self.vars.iter().enumerate() {
                if self.used[i].get() || v.kept() {
                    for r in &v.relocs {
                        if let RelocTarget::Var(t) = r.target {
                            if !self.used[t as usize].get() {
                                self.used[t as usize].set(true);
                                changed = true;
                            }
                        }
                    }
                }
            }
        }
        let (mut gsize, mut csize) = (0u64, 0u64);
        for (i, v) in self.vars.iter_mut().enumerate() {
            if !(self.used[i].get() || v.kept()) {
                continue;
            }
            let seg = if v.space == VarSpace::Global { &mut gsize } else { &mut csize };
            let off = seg.div_ceil(v.align) * v.align;
            let end = off.saturating_add(v.size.max(1));
            if end > MAX_SEGMENT {
                return Err(PtxError::at(0, "module variables exceed the largest segment"));
            }
            v.offset = Some(off);
            *seg = end;
        }
        let code = Arc::new(Code { insts: std::mem::take(&mut self.code), funcs: std::mem::take(&mut self.funcs), syms: vec![0; self.vars.len()] });
        for k in &mut kernels {
            k.code = code.clone();
        }
        Ok(Module { kernels, vars: std::mem::take(&mut self.vars), target: self.target, global_size: gsize, const_size: csize, code })
    }
}

/// Base opcodes the decoder understands; anything else is reported by name
/// before its operands are parsed.
const KNOWN_OPCODES: &[&str] = &[
    "mov",
    "ld",
    "ldu",
    "st",
    "cvta",
    "cvt",
    "add",
    "sub",
    "mul",
    "div",
    "rem",
    "min",
    "max",
    "and",
    "or",
    "xor",
    "shl",
    "shr",
    "copysign",
    "neg",
    "abs",
    "not",
    "sqrt",
    "rsqrt",
    "rcp",
    "ex2",
    "lg2",
    "sin",
    "cos",
    "tanh",
    "popc",
    "clz",
    "brev",
    "cnot",
    "mad",
    "fma",
    "setp",
    "set",
    "selp",
    "slct",
    "bra",
    "brx",
    "bar",
    "barrier",
    "membar",
    "fence",
    "shfl",
    "vote",
    "atom",
    "red",
    "ret",
    "exit",
    "bfe",
    "bfi",
    "bfind",
    "prmt",
    "lop3",
    "shf",
    "mul24",
    "mad24",
    "sad",
    "dp4a",
    "dp2a",
    "addc",
    "subc",
    "madc",
    "testp",
    "activemask",
    "match",
    "redux",
    "elect",
    "cp",
    "prefetch",
    "prefetchu",
    "isspacep",
    "mapa",
    "trap",
    "brkpt",
    "nanosleep",
    "pmevent",
    "griddepcontrol",
    "discard",
    "applypriority",
    "createpolicy",
    "mma",
    "wmma",
    "ldmatrix",
    "stmatrix",
];

enum Label {
    Bra(String),
    Table(String),
}

fn show<'b>(t: impl std::borrow::Borrow<Tok<'b>>) -> String {
    match *t.borrow() {
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
            // A cluster is one CTA on this device.
            "%clusterid" => Special::Ctaid(d),
            "%nclusterid" => Special::Nctaid(d),
            "%cluster_ctaid" => Special::Const(0),
            "%cluster_nctaid" => Special::Const(1),
            _ => return None,
        });
    }
    if let Some(n) = name.strip_prefix("%envreg") {
        return n.parse::<u32>().ok().filter(|n| *n < 32).map(|_| Special::Const(0));
    }
    if let Some(n) = name.strip_prefix("%pm") {
        let n = n.strip_suffix("_64").unwrap_or(n);
        return n.parse::<u32>().ok().filter(|n| *n < 8).map(|_| Special::Const(0));
    }
    Some(match name {
        "%laneid" => Special::LaneId,
        "%warpid" => Special::WarpId,
        "%nwarpid" => Special::NWarpId,
        "%clock" => Special::Clock,
        "%clock_hi" => Special::ClockHi,
        "%clock64" => Special::Clock64,
        "%lanemask_eq" => Special::LaneMaskEq,
        "%lanemask_lt" => Special::LaneMaskLt,
        "%lanemask_le" => Special::LaneMaskLe,
        "%lanemask_gt" => Special::LaneMaskGt,
        "%lanemask_ge" => Special::LaneMaskGe,
        "%smid" => Special::SmId,
        "%nsmid" => Special::NSmId,
        "%gridid" => Special::GridId,
        "%globaltimer" => Special::GlobalTimer,
        "%globaltimer_lo" => Special::GlobalTimerLo,
        "%globaltimer_hi" => Special::GlobalTimerHi,
        "%dynamic_smem_size" => Special::DynSmemSize,
        "%total_smem_size" => Special::TotalSmemSize,
        "%aggr_smem_size" => Special::TotalSmemSize,
        "%reserved_smem_offset_begin" | "%reserved_smem_offset_0" => Special::ReservedSmem(0),
        "%reserved_smem_offset_1" => Special::ReservedSmem(1),
        "%reserved_smem_offset_end" => Special::ReservedSmem(2),
        "%reserved_smem_offset_cap" => Special::ReservedSmem(3),
        "%cluster_ctarank" | "%is_explicit_cluster" => Special::Const(0),
        "%cluster_nctarank" => Special::Const(1),
        "%current_graph_exec" => Special::Const(0),
        _ => return None,
    })
}

/// Decoding context for one instruction.
struct Cx<'b, 'p, 'a, 'o> {
    b: &'b Body,
    p: &'p Parser<'a>,
    line: u32,
    opw: &'o str,
}

/// A name resolved in a body.
enum Named {
    Reg(u32),
    Special(Special),
    Imm(u64),
    /// Kernel parameter at this offset of the parameter buffer.
    KParam(u32),
    Local(u32),
    Shared(SharedVar),
    Var(u32),
    Func(u32),
}

impl Cx<'_, '_, '_, '_> {
    fn err<T>(&self, msg: impl Into<String>) -> Result<T, PtxError> {
        Err(PtxError::at(self.line, format!("'{}': {}", self.opw, msg.into())))
    }

    fn unsupported<T>(&self) -> Result<T, PtxError> {
        Err(PtxError::at(self.line, format!("unsupported instruction '{}'", self.opw)))
    }

    fn named(&self, n: &str) -> Option<Named> {
        if let Some((slot, _)) = self.b.reg(n) {
            return Some(Named::Reg(slot));
        }
        if let Some(s) = special(n) {
            return Some(Named::Special(s));
        }
        if n == "WARP_SZ" {
            return Some(Named::Imm(32));
        }
        if let Some(&(off, _)) = self.b.locals.get(n) {
            return Some(Named::Local(off));
        }
        if let Some(&off) = self.b.param_offsets.get(n) {
            return Some(Named::KParam(off));
        }
        if let Some(s) = self.b.shared.get(n).or_else(|| self.p.module_shared.get(n)) {
            return Some(Named::Shared(*s));
        }
        if let Some(&v) = self.p.var_names.get(n) {
            self.p.used[v as usize].set(true);
            return Some(Named::Var(v));
        }
        if let Some(&f) = self.p.func_names.get(n) {
            return Some(Named::Func(f));
        }
        None
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
        if matches!(r, Raw::Sink) {
            Ok(None)
        } else {
            self.reg(r).map(Some)
        }
    }

    fn src(&self, r: &Raw, ty: Ty) -> Result<Src, PtxError> {
        Ok(match r {
            Raw::Name(n) => match self.named(n) {
                Some(Named::Reg(s)) => Src::Reg(s),
                Some(Named::Special(s)) => Src::Special(s),
                Some(Named::Imm(v)) => Src::Imm(v),
                Some(Named::KParam(off)) => Src::Imm(off as u64),
                Some(Named::Local(off)) => Src::Local(off),
                Some(Named::Shared(SharedVar::Static(off))) => Src::Imm(off as u64),
                Some(Named::Shared(SharedVar::Dynamic)) => Src::Special(Special::DynShared),
                Some(Named::Var(v)) => Src::Sym(v),
                Some(Named::Func(f)) => Src::Imm(FUNC_WINDOW + f as u64),
                None => return self.err(format!("unknown operand '{n}'")),
            },
            Raw::Addr(base, off) if *off == 0 => return self.src(base, ty),
            Raw::Addr(..) => return self.err("an address with an offset is only allowed inside [..] here"),
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

    /// Resolves `[base+off]` for an access in `space`; returns the space
    /// the access really uses (a `.param` variable of a call is local).
    fn addr(&self, r: &Raw, space: Space) -> Result<(Space, Addr), PtxError> {
        let (base, offset) = match r {
            Raw::Addr(base, offset) => (&**base, *offset),
            _ => return self.err("expected an address [..]"),
        };
        let (sp, base, extra) = match base {
            Raw::Int(v) => (space, Src::Imm(*v as u64), 0),
            Raw::Name(n) => match self.named(n) {
                Some(Named::Reg(s)) => (space, Src::Reg(s), 0),
                Some(Named::KParam(off)) if matches!(space, Space::Param) => (Space::Param, Src::Imm(off as u64), 0),
                Some(Named::KParam(off)) if matches!(space, Space::Generic) => (Space::Generic, Src::Imm(off as u64), PARAM_WINDOW),
                Some(Named::Local(off)) if matches!(space, Space::Param | Space::Local) => (Space::Local, Src::Local(off), 0),
                Some(Named::Local(off)) if matches!(space, Space::Generic) => (Space::Generic, Src::Local(off), LOCAL_WINDOW),
                Some(Named::Shared(s)) if matches!(space, Space::Shared | Space::Generic) => {
                    let w = if space == Space::Generic { SHARED_WINDOW } else { 0 };
                    match s {
                        SharedVar::Static(off) => (space, Src::Imm(off as u64), w),
                        SharedVar::Dynamic => (space, Src::Special(Special::DynShared), w),
                    }
                }
                Some(Named::Var(v)) if matches!(space, Space::Global | Space::Generic) => (space, Src::Sym(v), 0),
                Some(_) => return self.err(format!("'{n}' cannot be addressed in this state space")),
                None => return self.err(format!("unknown address base '{n}'")),
            },
            other => return self.err(format!("bad address base {other:?}")),
        };
        Ok((sp, Addr { base, offset: offset.wrapping_add(extra as i64) }))
    }

    fn space(&self, mods: &[&str]) -> Result<Space, PtxError> {
        for m in mods {
            let m = m.split("::").next().unwrap_or(m);
            match m {
                "global" => return Ok(Space::Global),
                "shared" => return Ok(Space::Shared),
                "param" => return Ok(Space::Param),
                "local" => return Ok(Space::Local),
                // Constant memory is global memory the host fills.
                "const" => return Ok(Space::Global),
                "tex" | "surf" => return self.err("texture and surface memory are unsupported"),
                _ => {}
            }
        }
        Ok(Space::Generic)
    }

    fn mask_src(&self, r: Option<&Raw>) -> Result<Src, PtxError> {
        match r {
            Some(r) => self.src(r, Ty::B32),
            None => Ok(Src::Imm(0xffff_ffff)),
        }
    }

    /// `mma.sync.aligned.mMnNkK.row.col{.satfinite}.dtype.atype.btype.ctype
    /// d, a, b, c` with register vectors.
    fn mma(&self, mods: &[&str], ops: &[Raw]) -> Result<Mma, PtxError> {
        if let Some(m) = mods.iter().find(|m| m.starts_with("kind") || **m == "block_scale" || **m == "sp" || m.starts_with("sp::")) {
            return self.err(format!(".{m} (sparse, block-scaled or kind:: forms) is not supported on this device"));
        }
        if !mods.contains(&"sync") || !mods.contains(&"aligned") {
            return self.err("expected mma.sync.aligned");
        }
        let shape = mods.iter().find_map(|m| {
            let r = m.strip_prefix('m')?;
            let (mm, r) = r.split_once('n')?;
            let (nn, kk) = r.split_once('k')?;
            Some((mm.parse::<u32>().ok()?, nn.parse::<u32>().ok()?, kk.parse::<u32>().ok()?))
        });
        let Some((m, n, k)) = shape else { return self.err("missing shape (.m16n8k16, ...)") };
        if !(mods.contains(&"row") && mods.contains(&"col")) {
            return self.err("only the .row.col layout is supported");
        }
        let tys: Vec<MmaTy> = mods.iter().filter_map(|m| MmaTy::parse(m)).collect();
        let [dty, aty, bty, cty] = tys[..] else { return self.err("expected four types: .dtype.atype.btype.ctype") };
        let mixed_ints = matches!((aty, bty), (MmaTy::S8 | MmaTy::U8, MmaTy::S8 | MmaTy::U8));
        let mixed_fp8 = matches!((aty, bty), (MmaTy::E4m3 | MmaTy::E5m2, MmaTy::E4m3 | MmaTy::E5m2));
        if (aty != bty && !mixed_ints && !mixed_fp8) || dty != cty {
            return self.err(format!("mma types {}{}{}{} are not supported on this device", dty.name(), aty.name(), bty.name(), cty.name()));
        }
        let (na, nb, nc) = crate::mma::fragment_regs(m, n, k, aty, cty).or_else(|e| self.err(e))?;
        if ops.len() != 4 {
            return self.err(format!("expected 4 operands, found {}", ops.len()));
        }
        let (d, a, b, c) = self.mma_operands(ops, [nc, na, nb, nc], [aty, bty, cty])?;
        Ok(Mma { m, n, k, aty, bty, cty, dty, satfinite: mods.contains(&"satfinite"), wmma: false, d, a, b, c })
    }

    /// A fragment operand: `want` registers, in braces or (one) alone.
    fn fragment(&self, r: &Raw, want: usize, what: &str) -> Result<Vec<Raw>, PtxError> {
        let v = match r {
            Raw::Vec(v) => v.clone(),
            r => vec![r.clone()],
        };
        if v.len() != want {
            return self.err(format!("{what} takes {want} registers here, found {}", v.len()));
        }
        Ok(v)
    }

    /// The D, A, B and C operands of an `mma`/`wmma.mma`, with `counts`
    /// registers each, A, B and C read as `tys`.
    #[allow(clippy::type_complexity)]
    fn mma_operands(&self, ops: &[Raw], counts: [usize; 4], tys: [MmaTy; 3]) -> Result<(Vec<u32>, Vec<Src>, Vec<Src>, Vec<Src>), PtxError> {
        let srcs = |i: usize, what: &str, t: MmaTy| -> Result<Vec<Src>, PtxError> { self.fragment(&ops[i], counts[i], what)?.iter().map(|r| self.src(r, t.reg_ty())).collect() };
        let d = self.fragment(&ops[0], counts[0], "D")?.iter().map(|r| self.reg(r)).collect::<Result<_, _>>()?;
        Ok((d, srcs(1, "A", tys[0])?, srcs(2, "B", tys[1])?, srcs(3, "C", tys[2])?))
    }

    /// A `wmma` shape's (M, N, K), and whether this device runs it with
    /// operands of `ab`.
    fn wmma_shape(&self, mods: &[&str], ab: MmaTy) -> Result<(u32, u32, u32), PtxError> {
        let shape = mods.iter().find_map(|m| match *m {
            "m16n16k16" => Some((16, 16, 16)),
            "m32n8k16" => Some((32, 8, 16)),
            "m8n32k16" => Some((8, 32, 16)),
            "m16n16k8" => Some((16, 16, 8)),
            "m8n8k4" => Some((8, 8, 4)),
            _ => None,
        });
        let Some((m, n, k)) = shape else { return self.err("wmma shapes here: .m16n16k16, .m32n8k16, .m8n32k16, .m16n16k8 (tf32), .m8n8k4 (f64)") };
        let fits = match ab {
            MmaTy::F16 | MmaTy::Bf16 | MmaTy::S8 | MmaTy::U8 => k == 16,
            MmaTy::Tf32 => (m, n, k) == (16, 16, 8),
            MmaTy::F64 => (m, n, k) == (8, 8, 4),
            _ => false,
        };
        if !fits {
            return self.err(format!("wmma .m{m}n{n}k{k} with {} operands is not supported on this device", ab.name()));
        }
        Ok((m, n, k))
    }

    /// `wmma.load.{a,b,c}.sync.aligned.layout.shape{.ss}.type r, [p]{, stride}`
    /// and `wmma.store.d.sync.aligned.layout.shape{.ss}.type [p], r{, stride}`.
    fn wmma_move(&self, mods: &[&str], ops: &[Raw]) -> Result<WmmaMove, PtxError> {
        let store = mods.contains(&"store");
        let which = if store {
            'd'
        } else if mods.contains(&"a") {
            'a'
        } else if mods.contains(&"b") {
            'b'
        } else if mods.contains(&"c") {
            'c'
        } else {
            return self.err("expected wmma.load.a, .b, .c or wmma.store.d");
        };
        if !mods.contains(&"load") && !store {
            return self.err("expected wmma.load, wmma.store or wmma.mma");
        }
        let ty = mods.iter().find_map(|m| MmaTy::parse(m)).ok_or_else(|| PtxError::at(self.line, format!("'{}': missing element type", self.opw)))?;
        // The shape is checked against the operands' type: for C and D any
        // accumulator type of a supported shape.
        let ab = if matches!(which, 'a' | 'b') {
            ty
        } else {
            match ty {
                MmaTy::F64 => MmaTy::F64,
                MmaTy::S32 => MmaTy::S8,
                _ if mods.contains(&"m16n16k8") => MmaTy::Tf32,
                _ => MmaTy::F16,
            }
        };
        if matches!(which, 'c' | 'd') && !matches!(ty, MmaTy::F16 | MmaTy::F32 | MmaTy::S32 | MmaTy::F64) {
            return self.err(format!("wmma accumulators of {} are not supported", ty.name()));
        }
        let (m, n, k) = self.wmma_shape(mods, ab)?;
        let (rows, cols) = match which {
            'a' => (m, k),
            'b' => (k, n),
            _ => (m, n),
        };
        let row_major = if mods.contains(&"row") {
            true
        } else if mods.contains(&"col") {
            false
        } else {
            return self.err("missing .row or .col");
        };
        let space = self.space(mods)?;
        if matches!(space, Space::Param | Space::Local) {
            return self.err("wmma moves matrices to and from global and shared memory");
        }
        if ops.len() != 2 && ops.len() != 3 {
            return self.err(format!("expected 2 or 3 operands, found {}", ops.len()));
        }
        let want = crate::mma::wmma_regs(rows, cols, ty, matches!(which, 'a' | 'b')) as usize;
        let (regs, addr) = if store { (&ops[1], &ops[0]) } else { (&ops[0], &ops[1]) };
        let regs = self.fragment(regs, want, "this fragment")?;
        let (space, addr) = self.addr(addr, space)?;
        let stride = ops.get(2).map(|r| self.src(r, Ty::U32)).transpose()?;
        let (d, s) =
            if store { (Vec::new(), regs.iter().map(|r| self.src(r, ty.reg_ty())).collect::<Result<_, _>>()?) } else { (regs.iter().map(|r| self.reg(r)).collect::<Result<_, _>>()?, Vec::new()) };
        Ok(WmmaMove { store, rows, cols, ty, row_major, space, addr, stride, d, s })
    }

    /// `wmma.mma.sync.aligned.alayout.blayout.shape.dtype.ctype d, a, b, c`
    /// (f16 operands), or `.dtype.atype.btype.ctype` for the others.
    fn wmma_mma(&self, mods: &[&str], ops: &[Raw]) -> Result<Mma, PtxError> {
        let tys: Vec<MmaTy> = mods.iter().filter_map(|m| MmaTy::parse(m)).collect();
        let (dty, aty, bty, cty) = match tys[..] {
            [d, c] => (d, MmaTy::F16, MmaTy::F16, c),
            [d, a, b, c] => (d, a, b, c),
            _ => return self.err("expected .dtype.ctype (f16 operands) or .dtype.atype.btype.ctype"),
        };
        let ok = match (aty, bty) {
            (MmaTy::F16, MmaTy::F16) => matches!(cty, MmaTy::F16 | MmaTy::F32) && matches!(dty, MmaTy::F16 | MmaTy::F32),
            (MmaTy::Bf16, MmaTy::Bf16) | (MmaTy::Tf32, MmaTy::Tf32) => cty == MmaTy::F32 && dty == MmaTy::F32,
            (MmaTy::S8 | MmaTy::U8, MmaTy::S8 | MmaTy::U8) => cty == MmaTy::S32 && dty == MmaTy::S32,
            (MmaTy::F64, MmaTy::F64) => cty == MmaTy::F64 && dty == MmaTy::F64,
            _ => false,
        };
        if !ok {
            return self.err(format!("wmma.mma types {}{}{}{} are not supported on this device", dty.name(), aty.name(), bty.name(), cty.name()));
        }
        let (m, n, k) = self.wmma_shape(mods, aty)?;
        if ops.len() != 4 {
            return self.err(format!("expected 4 operands, found {}", ops.len()));
        }
        use crate::mma::wmma_regs;
        let counts = [wmma_regs(m, n, dty, false), wmma_regs(m, k, aty, true), wmma_regs(k, n, bty, true), wmma_regs(m, n, cty, false)].map(|c| c as usize);
        let (d, a, b, c) = self.mma_operands(ops, counts, [aty, bty, cty])?;
        Ok(Mma { m, n, k, aty, bty, cty, dty, satfinite: mods.contains(&"satfinite"), wmma: true, d, a, b, c })
    }

    /// `.m8n8.xN{.trans}{.shared}.b16` of ldmatrix/stmatrix: (N, trans, space).
    fn matrix_mods(&self, mods: &[&str]) -> Result<(u8, bool, Space), PtxError> {
        if !mods.contains(&"sync") || !mods.contains(&"aligned") {
            return self.err("expected .sync.aligned");
        }
        if !mods.contains(&"m8n8") || !mods.contains(&"b16") {
            return self.err("only .m8n8 tiles of .b16 are supported on this device");
        }
        let num = if mods.contains(&"x1") {
            1
        } else if mods.contains(&"x2") {
            2
        } else if mods.contains(&"x4") {
            4
        } else {
            return self.err("missing .x1, .x2 or .x4");
        };
        let space = self.space(mods)?;
        if !matches!(space, Space::Shared | Space::Generic) {
            return self.err("matrices move between registers and shared memory only");
        }
        Ok((num, mods.contains(&"trans"), space))
    }

    /// Returns the decoded op and, for branches, the label to resolve.
    fn decode(&self, ops: &[Raw]) -> Result<(Op, Option<Label>), PtxError> {
        let mut parts = self.opw.split('.');
        let base = parts.next().unwrap_or("");
        let mods: Vec<&str> = parts.collect();
        let has = |m: &str| mods.contains(&m);
        let types: Vec<Ty> = mods.iter().filter_map(|m| Ty::parse(m)).collect();
        let ty = types.last().copied();
        // `.L2::cache_hint` adds a last operand, a cache policy (from
        // `createpolicy`): a hint this device has no use for.
        let ops = match ops.split_last() {
            Some((policy, rest)) if has("L2::cache_hint") => {
                self.src(policy, Ty::B64)?;
                rest
            }
            _ => ops,
        };
        let need = |n: usize| -> Result<(), PtxError> {
            if ops.len() != n {
                self.err(format!("expected {n} operands, found {}", ops.len()))
            } else {
                Ok(())
            }
        };
        let the_ty = || ty.ok_or_else(|| PtxError::at(self.line, format!("'{}': missing type", self.opw)));
        let round = || {
            if has("rn") {
                Round::Rn
            } else if has("rz") {
                Round::Rz
            } else if has("rm") {
                Round::Rm
            } else if has("rp") {
                Round::Rp
            } else if has("rna") {
                Round::Rna
            } else if has("rni") {
                Round::Rni
            } else if has("rzi") {
                Round::Rzi
            } else if has("rmi") {
                Round::Rmi
            } else if has("rpi") {
                Round::Rpi
            } else {
                Round::Default
            }
        };
        let op = match base {
            "mov" => {
                need(2)?;
                let ty = the_ty()?;
                match (&ops[0], &ops[1]) {
                    (Raw::Vec(d), a) => {
                        let d = d.iter().map(|r| self.opt_reg(r)).collect::<Result<Vec<_>, _>>()?;
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
                let ty = the_ty()?;
                let (d, dst_bits) = match &ops[0] {
                    Raw::Vec(v) => (v.iter().map(|r| self.reg(r)).collect::<Result<Vec<_>, _>>()?, self.reg_bits(&v[0])),
                    r => (vec![self.reg(r)?], self.reg_bits(r)),
                };
                let (space, addr) = self.addr(&ops[1], self.space(&mods)?)?;
                Op::Ld { space, ty, d, addr, dst_bits }
            }
            "st" => {
                need(2)?;
                if has("const") {
                    return self.err("constant memory is read-only to kernels");
                }
                let ty = the_ty()?;
                let s = match &ops[1] {
                    Raw::Vec(v) => v.iter().map(|r| self.src(r, ty)).collect::<Result<Vec<_>, _>>()?,
                    r => vec![self.src(r, ty)?],
                };
                let (space, addr) = self.addr(&ops[0], self.space(&mods)?)?;
                if space == Space::Param {
                    return self.err("kernel parameters are read-only");
                }
                Op::St { space, ty, addr, s }
            }
            "cvta" => {
                need(2)?;
                let window = match self.space(&mods)? {
                    Space::Shared => SHARED_WINDOW,
                    Space::Local => LOCAL_WINDOW,
                    Space::Param => PARAM_WINDOW,
                    Space::Global => 0,
                    Space::Generic => return self.err("missing state space"),
                };
                let ty = the_ty()?;
                Op::Cvta { to_generic: !has("to"), window, d: self.reg(&ops[0])?, a: self.src(&ops[1], ty)? }
            }
            "cvt" if mods.iter().any(|m| *m == "e4m3x2" || *m == "e5m2x2") => {
                if !has("rn") {
                    return self.err("FP8 conversions need .rn");
                }
                let e5m2 = has("e5m2x2");
                let to_fp8 = mods.iter().position(|m| *m == "e4m3x2" || *m == "e5m2x2") < mods.iter().position(|m| *m == "f32" || *m == "f16x2");
                if to_fp8 {
                    if !has("satfinite") {
                        return self.err("a conversion to FP8 needs .satfinite");
                    }
                    if has("f32") {
                        need(3)?;
                        Op::CvtToFp8x2 { e5m2, relu: has("relu"), from_f16x2: false, d: self.reg(&ops[0])?, hi: self.src(&ops[1], Ty::F32)?, lo: self.src(&ops[2], Ty::F32)? }
                    } else {
                        need(2)?;
                        Op::CvtToFp8x2 { e5m2, relu: has("relu"), from_f16x2: true, d: self.reg(&ops[0])?, hi: self.src(&ops[1], Ty::B32)?, lo: Src::Imm(0) }
                    }
                } else {
                    need(2)?;
                    if !has("f16x2") {
                        return self.err("FP8 pairs convert to .f16x2 only");
                    }
                    Op::CvtFromFp8x2 { e5m2, relu: has("relu"), d: self.reg(&ops[0])?, a: self.src(&ops[1], Ty::B16)? }
                }
            }
            "cvt" if has("pack") && has("sat") && has("s32") => {
                // cvt.pack.sat.{u16,s16}.s32 d, a, b and
                // cvt.pack.sat.{u8,s8,u4,s4,u2,s2}.s32.b32 d, a, b, c.
                let (bits, signed) = match mods.iter().find(|m| matches!(**m, "u16" | "s16" | "u8" | "s8" | "u4" | "s4" | "u2" | "s2")) {
                    Some(m) => (m[1..].parse::<u32>().unwrap_or(16), m.starts_with('s')),
                    None => return self.err("expected .u16, .s16, .u8, .s8, .u4, .s4, .u2 or .s2"),
                };
                let c = if bits == 16 {
                    need(3)?;
                    None
                } else {
                    need(4)?;
                    Some(self.src(&ops[3], Ty::B32)?)
                };
                Op::CvtPack { bits, signed, d: self.reg(&ops[0])?, a: self.src(&ops[1], Ty::S32)?, b: self.src(&ops[2], Ty::S32)?, c }
            }
            "cvt" if has("tf32") => {
                need(2)?;
                if !has("f32") || types.len() != 1 {
                    return self.err("only cvt to .tf32 from .f32 is supported");
                }
                let round = if has("rna") {
                    Round::Rna
                } else if has("rn") {
                    Round::Rn
                } else if has("rz") {
                    Round::Rz
                } else {
                    return self.err("cvt to .tf32 needs .rna, .rn or .rz");
                };
                Op::CvtTf32 { round, d: self.reg(&ops[0])?, a: self.src(&ops[1], Ty::F32)? }
            }
            "mma" => return Ok((Op::Mma(Box::new(self.mma(&mods, ops)?)), None)),
            "wmma" if has("mma") => return Ok((Op::Mma(Box::new(self.wmma_mma(&mods, ops)?)), None)),
            "wmma" => return Ok((Op::Wmma(Box::new(self.wmma_move(&mods, ops)?)), None)),
            "ldmatrix" | "stmatrix" => {
                need(2)?;
                let (num, trans, space) = self.matrix_mods(&mods)?;
                let load = base == "ldmatrix";
                let (regs, addr) = if load { (&ops[0], &ops[1]) } else { (&ops[1], &ops[0]) };
                let regs: Vec<&Raw> = match regs {
                    Raw::Vec(v) => v.iter().collect(),
                    r => vec![r],
                };
                if regs.len() != num as usize {
                    return self.err(format!(".x{num} takes {num} registers, found {}", regs.len()));
                }
                let (space, addr) = self.addr(addr, space)?;
                if load {
                    Op::Ldmatrix { num, trans, space, d: regs.iter().map(|r| self.reg(r)).collect::<Result<_, _>>()?, addr }
                } else {
                    Op::Stmatrix { num, trans, space, addr, s: regs.iter().map(|r| self.src(r, Ty::B32)).collect::<Result<_, _>>()? }
                }
            }
            "cvt" => {
                if types.len() != 2 {
                    return self.err("expected destination and source types");
                }
                if ops.len() == 3 {
                    // cvt.rn.f16x2.f32 d, hi, lo
                    return Ok((Op::Cvt2 { dty: types[0], round: round(), relu: has("relu"), d: self.reg(&ops[0])?, hi: self.src(&ops[1], types[1])?, lo: self.src(&ops[2], types[1])? }, None));
                }
                need(2)?;
                Op::Cvt { dty: types[0], sty: types[1], round: round(), sat: has("sat"), relu: has("relu"), d: self.reg(&ops[0])?, a: self.src(&ops[1], types[1])? }
            }
            "add" | "sub" | "addc" | "subc" if has("cc") || base == "addc" || base == "subc" => {
                need(3)?;
                let ty = the_ty()?;
                let sub = base.starts_with("sub");
                Op::Carry { sub, cin: base.ends_with('c'), cout: has("cc"), ty, d: self.reg(&ops[0])?, a: self.src(&ops[1], ty)?, b: self.src(&ops[2], ty)? }
            }
            "min" | "max" if mods.iter().any(|m| *m == "s16x2" || *m == "u16x2") => {
                need(3)?;
                let signed = has("s16x2");
                let relu = has("relu");
                if relu && !signed {
                    return self.unsupported();
                }
                let (d, a, b) = (self.reg(&ops[0])?, self.src(&ops[1], Ty::B32)?, self.src(&ops[2], Ty::B32)?);
                Op::MinMax16x2 { max: base == "max", signed, relu, d, a, b }
            }
            "add" | "sub" | "mul" | "div" | "rem" | "min" | "max" | "and" | "or" | "xor" | "shl" | "shr" | "copysign" | "mul24" => {
                if mods.iter().any(|m| *m == "xorsign" || *m == "abs") {
                    return self.unsupported();
                }
                need(3)?;
                let ty = the_ty()?;
                let relu = has("relu");
                let nan = has("NaN");
                let sat = has("sat") && ty.is_float();
                let op = match base {
                    "add" if sat => Bin::AddSat,
                    "sub" if sat => Bin::SubSat,
                    "mul" if sat => Bin::MulSat,
                    "add" => Bin::Add,
                    "sub" => Bin::Sub,
                    "mul" if has("wide") => Bin::MulWide,
                    "mul" if has("hi") => Bin::MulHi,
                    "mul" => Bin::MulLo,
                    "mul24" if has("hi") => Bin::Mul24Hi,
                    "mul24" => Bin::Mul24Lo,
                    "div" => Bin::Div,
                    "rem" => Bin::Rem,
                    "min" if relu => Bin::MinRelu,
                    "max" if relu => Bin::MaxRelu,
                    "min" if nan => Bin::MinNan,
                    "max" if nan => Bin::MaxNan,
                    "min" => Bin::Min,
                    "max" => Bin::Max,
                    "and" => Bin::And,
                    "or" => Bin::Or,
                    "xor" => Bin::Xor,
                    "shl" => Bin::Shl,
                    "shr" => Bin::Shr,
                    _ => Bin::Copysign,
                };
                if has("sat") && !ty.is_float() && !(op == Bin::Add || op == Bin::Sub) {
                    return self.unsupported();
                }
                // Shift amounts are always .u32.
                let bty = if matches!(op, Bin::Shl | Bin::Shr) { Ty::U32 } else { ty };
                let (d, a, b) = (self.reg(&ops[0])?, self.src(&ops[1], ty)?, self.src(&ops[2], bty)?);
                let r = round();
                if ty.is_float() && matches!(r, Round::Rz | Round::Rm | Round::Rp) && matches!(op, Bin::Add | Bin::Sub | Bin::MulLo | Bin::Div) && matches!(ty, Ty::F32 | Ty::F64) {
                    Op::BinR { op, ty, round: r, d, a, b }
                } else if has("sat") && !ty.is_float() {
                    // add.sat.s32 / sub.sat.s32: saturating integer.
                    Op::BinR { op, ty, round: Round::Default, d, a, b }
                } else {
                    Op::Bin { op, ty, d, a, b }
                }
            }
            "neg" | "abs" | "not" | "sqrt" | "rsqrt" | "rcp" | "ex2" | "lg2" | "sin" | "cos" | "tanh" | "popc" | "clz" | "brev" | "cnot" | "bfind" => {
                need(2)?;
                let ty = the_ty()?;
                let r = round();
                if matches!(base, "sqrt" | "rcp") && matches!(r, Round::Rz | Round::Rm | Round::Rp) && matches!(ty, Ty::F32 | Ty::F64) {
                    let (d, x) = (self.reg(&ops[0])?, self.src(&ops[1], ty)?);
                    let one = if ty == Ty::F32 { 1f32.to_bits() as u64 } else { 1f64.to_bits() };
                    return Ok((if base == "sqrt" { Op::BinR { op: Bin::Sqrt, ty, round: r, d, a: x, b: x } } else { Op::BinR { op: Bin::Div, ty, round: r, d, a: Src::Imm(one), b: x } }, None));
                }
                let op = match base {
                    "neg" => Un::Neg,
                    "abs" => Un::Abs,
                    "not" => Un::Not,
                    "sqrt" => Un::Sqrt,
                    "rsqrt" => Un::Rsqrt,
                    "rcp" => Un::Rcp,
                    "ex2" => Un::Ex2,
                    "lg2" => Un::Lg2,
                    "sin" => Un::Sin,
                    "cos" => Un::Cos,
                    "tanh" => Un::Tanh,
                    "popc" => Un::Popc,
                    "clz" => Un::Clz,
                    "brev" => Un::Brev,
                    "bfind" if has("shiftamt") => Un::BfindShift,
                    "bfind" => Un::Bfind,
                    _ => Un::Cnot,
                };
                Op::Un { op, ty, d: self.reg(&ops[0])?, a: self.src(&ops[1], ty)? }
            }
            "mad" | "fma" | "madc" | "mad24" => {
                need(4)?;
                let ty = the_ty()?;
                let (d, a, b, c) = (self.reg(&ops[0])?, &ops[1], &ops[2], &ops[3]);
                if ty.is_float() {
                    Op::Fma { ty, round: round(), d, a: self.src(a, ty)?, b: self.src(b, ty)?, c: self.src(c, ty)?, sat: has("sat"), relu: has("relu") }
                } else {
                    let mode = if base == "mad24" {
                        if has("hi") {
                            MadMode::Hi24
                        } else {
                            MadMode::Lo24
                        }
                    } else if has("wide") {
                        MadMode::Wide
                    } else if has("hi") {
                        MadMode::Hi
                    } else {
                        MadMode::Lo
                    };
                    if has("sat") {
                        return self.unsupported();
                    }
                    let cty = if mode == MadMode::Wide { wide(ty) } else { ty };
                    Op::Mad { mode, ty, d, a: self.src(a, ty)?, b: self.src(b, ty)?, c: self.src(c, cty)?, carry: (base == "madc", has("cc")) }
                }
            }
            "bfe" | "prmt" | "lop3" | "shf" | "sad" | "dp4a" | "dp2a" => {
                let ty = if base == "dp4a" || base == "dp2a" { Ty::U32 } else { the_ty()? };
                let op = match base {
                    "bfe" => Tri::Bfe,
                    "prmt" => Tri::Prmt(if has("f4e") {
                        1
                    } else if has("b4e") {
                        2
                    } else if has("rc8") {
                        3
                    } else if has("ecl") {
                        4
                    } else if has("ecr") {
                        5
                    } else if has("rc16") {
                        6
                    } else {
                        0
                    }),
                    "lop3" => {
                        need(5)?;
                        let Raw::Int(lut) = &ops[4] else { return self.err("the lookup table must be an immediate") };
                        Tri::Lop3(*lut as u8)
                    }
                    "shf" => Tri::Shf { left: has("l"), wrap: has("wrap") },
                    "sad" => Tri::Sad,
                    "dp4a" => Tri::Dp4a(mods.first() == Some(&"s32"), mods.get(1) == Some(&"s32")),
                    _ => Tri::Dp2a { hi: has("hi"), sa: mods.get(1) == Some(&"s32"), sb: mods.get(2) == Some(&"s32") },
                };
                if base != "lop3" {
                    need(4)?;
                }
                let (bt, ct) = match op {
                    Tri::Bfe => (Ty::U32, Ty::U32),
                    Tri::Shf { .. } => (Ty::B32, Ty::U32),
                    Tri::Sad => (ty, wide_none(ty)),
                    _ => (ty, ty),
                };
                Op::Tri { op, ty, d: self.reg(&ops[0])?, a: self.src(&ops[1], ty)?, b: self.src(&ops[2], bt)?, c: self.src(&ops[3], ct)? }
            }
            "bfi" => {
                need(5)?;
                let ty = the_ty()?;
                Op::Bfi { ty, d: self.reg(&ops[0])?, f: self.src(&ops[1], ty)?, b: self.src(&ops[2], ty)?, pos: self.src(&ops[3], Ty::U32)?, len: self.src(&ops[4], Ty::U32)? }
            }
            "testp" => {
                need(2)?;
                let ty = the_ty()?;
                let kind = if has("finite") {
                    TestpKind::Finite
                } else if has("infinite") {
                    TestpKind::Infinite
                } else if has("number") {
                    TestpKind::Number
                } else if has("notanumber") {
                    TestpKind::NotANumber
                } else if has("normal") {
                    TestpKind::Normal
                } else if has("subnormal") {
                    TestpKind::Subnormal
                } else {
                    return self.err("missing test");
                };
                Op::Testp { kind, ty, p: self.reg(&ops[0])?, a: self.src(&ops[1], ty)? }
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
                    let bop = if has("and") {
                        BoolOp::And
                    } else if has("or") {
                        BoolOp::Or
                    } else if has("xor") {
                        BoolOp::Xor
                    } else {
                        return self.err("a fourth operand needs .and, .or or .xor");
                    };
                    let (c, neg) = match &ops[3] {
                        Raw::Not(c) => (&**c, true),
                        c => (c, false),
                    };
                    Some((bop, self.src(c, Ty::Pred)?, neg))
                } else {
                    None
                };
                Op::Setp { cmp, ty, p, q, a: self.src(&ops[1], ty)?, b: self.src(&ops[2], ty)?, comb }
            }
            "set" => {
                need(3)?;
                if types.len() != 2 {
                    return self.err("expected destination and source types");
                }
                let cmp = mods.iter().find_map(|m| cmp(m)).ok_or_else(|| PtxError::at(self.line, format!("'{}': missing comparison", self.opw)))?;
                Op::Set { cmp, dty: types[0], ty: types[1], d: self.reg(&ops[0])?, a: self.src(&ops[1], types[1])?, b: self.src(&ops[2], types[1])? }
            }
            "selp" => {
                need(4)?;
                let ty = the_ty()?;
                Op::Selp { ty, d: self.reg(&ops[0])?, a: self.src(&ops[1], ty)?, b: self.src(&ops[2], ty)?, p: self.src(&ops[3], Ty::Pred)? }
            }
            "slct" => {
                need(4)?;
                if types.len() != 2 {
                    return self.err("expected destination and source types");
                }
                Op::Slct { ty: types[0], cty: types[1], d: self.reg(&ops[0])?, a: self.src(&ops[1], types[0])?, b: self.src(&ops[2], types[0])?, c: self.src(&ops[3], types[1])? }
            }
            "bra" => {
                need(1)?;
                let Raw::Name(l) = &ops[0] else { return self.err("expected a label") };
                return Ok((Op::Bra { target: 0 }, Some(Label::Bra(l.clone()))));
            }
            "brx" => {
                need(2)?;
                let Raw::Name(t) = &ops[1] else { return self.err("expected a branch table") };
                return Ok((Op::Brx { index: self.src(&ops[0], Ty::U32)?, targets: Vec::new() }, Some(Label::Table(t.clone()))));
            }
            "bar" | "barrier" => {
                if has("cluster") {
                    let kind = if has("arrive") { BarKind::ClusterArrive } else { BarKind::ClusterWait };
                    Op::Bar { kind, id: Src::Imm(16), count: None, d: None, a: None }
                } else if has("warp") {
                    need(1)?;
                    Op::WarpSync { mask: self.src(&ops[0], Ty::B32)? }
                } else if has("red") {
                    // bar.red.op.type d, a{, b}, {!}c
                    if ops.len() != 3 && ops.len() != 4 {
                        return self.err("expected 3 or 4 operands");
                    }
                    let kind = if has("popc") {
                        BarKind::RedPopc
                    } else if has("and") {
                        BarKind::RedAnd
                    } else if has("or") {
                        BarKind::RedOr
                    } else {
                        return self.err("missing reduction");
                    };
                    let count = if ops.len() == 4 { Some(self.src(&ops[2], Ty::U32)?) } else { None };
                    let (c, neg) = match ops.last() {
                        Some(Raw::Not(c)) => (&**c, true),
                        Some(c) => (c, false),
                        None => return self.err("missing predicate"),
                    };
                    Op::Bar { kind, id: self.src(&ops[1], Ty::U32)?, count, d: Some(self.reg(&ops[0])?), a: Some((self.src(c, Ty::Pred)?, neg)) }
                } else {
                    let kind = if has("arrive") { BarKind::Arrive } else { BarKind::Sync };
                    if ops.is_empty() || ops.len() > 2 {
                        return self.err("expected a barrier and an optional thread count");
                    }
                    let count = ops.get(1).map(|c| self.src(c, Ty::U32)).transpose()?;
                    Op::Bar { kind, id: self.src(&ops[0], Ty::U32)?, count, d: None, a: None }
                }
            }
            "membar" | "fence" => Op::Fence,
            "prefetch" | "prefetchu" | "nanosleep" | "pmevent" | "griddepcontrol" | "discard" | "applypriority" => Op::Nop,
            "createpolicy" => {
                need(2).or_else(|_| need(3)).or_else(|_| need(4))?;
                Op::Mov { ty: Ty::B64, d: self.reg(&ops[0])?, a: Src::Imm(0) }
            }
            "shfl" => {
                if !has("sync") {
                    return self.err("only shfl.sync is supported (sm_70 and later)");
                }
                need(5)?;
                let mode = if has("up") {
                    ShflMode::Up
                } else if has("down") {
                    ShflMode::Down
                } else if has("bfly") {
                    ShflMode::Bfly
                } else if has("idx") {
                    ShflMode::Idx
                } else {
                    return self.err("missing shuffle mode");
                };
                let (d, p) = match &ops[0] {
                    Raw::Pair(d, p) => (self.reg(d)?, self.opt_reg(p)?),
                    d => (self.reg(d)?, None),
                };
                Op::Shfl { mode, d, p, a: self.src(&ops[1], Ty::B32)?, b: self.src(&ops[2], Ty::U32)?, c: self.src(&ops[3], Ty::U32)?, mask: self.src(&ops[4], Ty::B32)? }
            }
            "vote" => {
                if ops.len() != 2 && ops.len() != 3 {
                    return self.err("expected 2 or 3 operands");
                }
                let mode = if has("all") {
                    VoteMode::All
                } else if has("any") {
                    VoteMode::Any
                } else if has("uni") {
                    VoteMode::Uni
                } else if has("ballot") {
                    VoteMode::Ballot
                } else {
                    return self.err("missing vote mode");
                };
                let (a, negate) = match &ops[1] {
                    Raw::Not(a) => (&**a, true),
                    a => (a, false),
                };
                // Without .sync, every lane that gets there votes.
                let mask = if has("sync") { self.mask_src(ops.get(2))? } else { Src::Imm(0) };
                Op::Vote { mode, d: self.reg(&ops[0])?, a: self.src(a, Ty::Pred)?, negate, mask }
            }
            "match" => {
                need(3)?;
                let ty = the_ty()?;
                let (d, p) = match &ops[0] {
                    Raw::Pair(d, p) => (self.reg(d)?, self.opt_reg(p)?),
                    d => (self.reg(d)?, None),
                };
                Op::Match { all: has("all"), ty, d, p, a: self.src(&ops[1], ty)?, mask: self.src(&ops[2], Ty::B32)? }
            }
            "redux" => {
                need(3)?;
                let ty = the_ty()?;
                if ty.is_float() {
                    return self.unsupported();
                }
                let op = if has("add") {
                    ReduxOp::Add
                } else if has("min") {
                    ReduxOp::Min
                } else if has("max") {
                    ReduxOp::Max
                } else if has("and") {
                    ReduxOp::And
                } else if has("or") {
                    ReduxOp::Or
                } else if has("xor") {
                    ReduxOp::Xor
                } else {
                    return self.err("missing operation");
                };
                Op::Redux { op, ty, d: self.reg(&ops[0])?, a: self.src(&ops[1], ty)?, mask: self.src(&ops[2], Ty::B32)? }
            }
            "elect" => {
                need(2)?;
                let (d, p) = match &ops[0] {
                    Raw::Pair(d, p) => (self.opt_reg(d)?, self.opt_reg(p)?),
                    d => (self.opt_reg(d)?, None),
                };
                Op::Elect { d, p, mask: self.src(&ops[1], Ty::B32)? }
            }
            "activemask" => {
                need(1)?;
                Op::ActiveMask { d: self.reg(&ops[0])? }
            }
            "atom" | "red" => {
                let ty = the_ty()?;
                let aop = mods
                    .iter()
                    .find_map(|m| {
                        Some(match *m {
                            "add" => AtomOp::Add,
                            "min" => AtomOp::Min,
                            "max" => AtomOp::Max,
                            "exch" => AtomOp::Exch,
                            "cas" => AtomOp::Cas,
                            "and" => AtomOp::And,
                            "or" => AtomOp::Or,
                            "xor" => AtomOp::Xor,
                            "inc" => AtomOp::Inc,
                            "dec" => AtomOp::Dec,
                            _ => return None,
                        })
                    })
                    .ok_or_else(|| PtxError::at(self.line, format!("'{}': missing atomic operation", self.opw)))?;
                if has("v2") || has("v4") || has("v8") {
                    return self.unsupported();
                }
                let float_ok = match ty {
                    Ty::F32 | Ty::F64 => matches!(aop, AtomOp::Add | AtomOp::Exch | AtomOp::Min | AtomOp::Max),
                    Ty::F16 | Ty::Bf16 | Ty::F16x2 | Ty::Bf16x2 => matches!(aop, AtomOp::Add | AtomOp::Min | AtomOp::Max),
                    _ => true,
                };
                if !float_ok || (ty.bits() < 32 && !ty.is_float() && aop != AtomOp::Cas) {
                    return self.unsupported();
                }
                let sp = self.space(&mods)?;
                if sp == Space::Param || sp == Space::Local {
                    return self.err("atomics work on global and shared memory only");
                }
                let (d, rest) = if base == "atom" { (Some(self.reg(ops.first().ok_or_else(|| PtxError::at(self.line, "missing operands"))?)?), ops.get(1..).unwrap_or(&[])) } else { (None, ops) };
                let want = if aop == AtomOp::Cas { 3 } else { 2 };
                if rest.len() != want && rest.len() != want + 1 {
                    return self.err(format!("expected {} operands", want + d.is_some() as usize));
                }
                let c = if aop == AtomOp::Cas { Some(self.src(&rest[2], ty)?) } else { None };
                let (space, addr) = self.addr(&rest[0], sp)?;
                Op::Atom { space, op: aop, ty, d, addr, b: self.src(&rest[1], ty)?, c }
            }
            "cp" => {
                if !has("async") {
                    return self.unsupported();
                }
                if has("commit_group") || has("wait_group") || has("wait_all") || has("mbarrier") {
                    Op::Nop
                } else if has("bulk") {
                    return self.err("bulk asynchronous copies (TMA) are unsupported");
                } else {
                    if ops.len() < 3 {
                        return self.err("expected destination, source and size");
                    }
                    let (_, dst) = self.addr(&ops[0], Space::Shared)?;
                    let (_, src) = self.addr(&ops[1], Space::Global)?;
                    let Raw::Int(size) = &ops[2] else { return self.err("the copy size must be an immediate") };
                    if !matches!(*size, 4 | 8 | 16) {
                        return self.err("copy size must be 4, 8 or 16");
                    }
                    let src_size = match ops.get(3) {
                        Some(Raw::Name(n)) if self.b.reg(n).map(|r| r.1) == Some(Ty::Pred) => None,
                        Some(r) => Some(self.src(r, Ty::U32)?),
                        None => None,
                    };
                    Op::CpAsync { dst, src, size: *size as u32, src_size }
                }
            }
            "mapa" => {
                // A cluster is one CTA here: rank 0 is this block itself.
                need(3)?;
                let ty = the_ty()?;
                Op::Mov { ty, d: self.reg(&ops[0])?, a: self.src(&ops[1], ty)? }
            }
            "isspacep" => {
                need(2)?;
                let space = match self.space(&mods)? {
                    Space::Generic => return self.err("missing state space"),
                    s => s,
                };
                Op::Isspacep { space, p: self.reg(&ops[0])?, a: self.src(&ops[1], Ty::U64)? }
            }
            "ret" => Op::Ret,
            "exit" => Op::Exit,
            "trap" | "brkpt" => Op::Trap,
            _ => return self.unsupported(),
        };
        Ok((op, None))
    }
}

fn wide(t: Ty) -> Ty {
    match t {
        Ty::U16 => Ty::U32,
        Ty::S16 => Ty::S32,
        Ty::U32 => Ty::U64,
        Ty::S32 => Ty::S64,
        other => other,
    }
}

/// `sad`'s accumulator is unsigned of the same width.
fn wide_none(t: Ty) -> Ty {
    match t {
        Ty::S16 => Ty::U16,
        Ty::S32 => Ty::U32,
        Ty::S64 => Ty::U64,
        other => other,
    }
}

fn cmp(m: &str) -> Option<Cmp> {
    Some(match m {
        "eq" => Cmp::Eq,
        "ne" => Cmp::Ne,
        "lt" => Cmp::Lt,
        "le" => Cmp::Le,
        "gt" => Cmp::Gt,
        "ge" => Cmp::Ge,
        "lo" => Cmp::Lo,
        "ls" => Cmp::Ls,
        "hi" => Cmp::Hi,
        "hs" => Cmp::Hs,
        "equ" => Cmp::Equ,
        "neu" => Cmp::Neu,
        "ltu" => Cmp::Ltu,
        "leu" => Cmp::Leu,
        "gtu" => Cmp::Gtu,
        "geu" => Cmp::Geu,
        "num" => Cmp::Num,
        "nan" => Cmp::Nan,
        _ => return None,
    })
}
