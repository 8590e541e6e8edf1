//! A PTX-level linker for `cuLinkComplete`: this device loads PTX, so
//! linking PTX modules means merging them into one module whose external
//! declarations resolve to the definitions the others carry.

/// A top-level PTX statement: a directive ending in `;` or a definition
/// ending in its closing brace.
struct Item<'a> {
    text: &'a str,
    /// A definition (it has a body or an initialiser), not a declaration.
    defines: bool,
    /// `.extern`: a reference to something defined elsewhere.
    external: bool,
    name: Option<String>,
}

/// Splits PTX text into its header directives and its top-level items.
fn items(text: &str) -> Result<(Vec<&str>, Vec<Item<'_>>), String> {
    let b = text.as_bytes();
    let (mut header, mut out) = (Vec::new(), Vec::new());
    let (mut i, mut start, mut depth) = (0usize, 0usize, 0i32);
    while i < b.len() {
        match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
                if depth == 0 && text[start..i].trim().starts_with("//") {
                    start = i;
                }
                continue;
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                i = text[i + 2..].find("*/").map(|k| i + 2 + k + 2).ok_or("unterminated comment")?;
                continue;
            }
            b'"' => {
                i = text[i + 1..].find('"').map(|k| i + 1 + k + 1).ok_or("unterminated string")?;
                continue;
            }
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth < 0 {
                    return Err("unbalanced braces".into());
                }
                if depth == 0 {
                    out.push(item(&text[start..=i], true));
                    start = i + 1;
                }
            }
            b';' if depth == 0 => {
                out.push(item(&text[start..=i], false));
                start = i + 1;
            }
            b'\n' if depth == 0 => {
                let line = text[start..i].trim();
                if [".version", ".target", ".address_size"].iter().any(|d| line.starts_with(d)) {
                    header.push(line);
                    start = i + 1;
                }
            }
            _ => {}
        }
        i += 1;
    }
    if depth != 0 {
        return Err("unbalanced braces".into());
    }
    Ok((header, out))
}

fn item(text: &str, body: bool) -> Item<'_> {
    let t = text.trim();
    let words: Vec<&str> = t.split_whitespace().collect();
    let external = words.first() == Some(&".extern");
    let is_fn = words.iter().any(|w| *w == ".func" || *w == ".entry");
    let name = if is_fn { fn_name(t) } else { var_name(t) };
    let defines = body || (!is_fn && !external && t.contains('='));
    let defines = defines || (!is_fn && !external && name.is_some() && [".global", ".const"].iter().any(|d| words.contains(d)));
    Item { text, defines, external, name }
}

fn ident(s: &str) -> Option<String> {
    let n: String = s.trim_start().chars().take_while(|c| c.is_alphanumeric() || matches!(c, '_' | '$' | '%')).collect();
    (!n.is_empty()).then_some(n)
}

/// The name in `.func (.param ...) NAME (...)` or `.entry NAME (...)`.
fn fn_name(t: &str) -> Option<String> {
    let k = t.find(".func").or_else(|| t.find(".entry"))?;
    let rest = t[k..].split_once(char::is_whitespace)?.1.trim_start();
    let rest = if let Some(r) = rest.strip_prefix('(') { &r[r.find(')')? + 1..] } else { rest };
    ident(rest)
}

/// The name of a variable: the last identifier before `[`, `=` or `;`.
fn var_name(t: &str) -> Option<String> {
    let end = t.find(['[', '=', ';']).unwrap_or(t.len());
    let last = t[..end].split_whitespace().last()?;
    (!last.starts_with('.')).then(|| ident(last)).flatten()
}

fn version(line: &str) -> (u32, u32) {
    let v = line.split_whitespace().nth(1).unwrap_or("0.0");
    let (a, b) = v.split_once('.').unwrap_or((v, "0"));
    (a.parse().unwrap_or(0), b.parse().unwrap_or(0))
}

/// The highest `sm_XY` a `.target` line names (0 if none).
pub(crate) fn target_arch(line: &str) -> u32 {
    target_word(line).map_or(0, |(a, _)| a)
}

/// The `.target` line's highest architecture and how it is written
/// (`sm_90a` keeps its suffix: architecture- and family-specific code
/// compiles only for what the suffix names).
fn target_word(line: &str) -> Option<(u32, &str)> {
    line.split(|c: char| c.is_whitespace() || c == ',')
        .filter_map(|w| Some((w.strip_prefix("sm_")?.trim_end_matches(|c: char| c.is_alphabetic()).parse().ok()?, w)))
        .max_by_key(|(a, w): &(u32, &str)| (*a, w.len()))
}

/// Merges PTX modules into one. The result uses the newest PTX version
/// and the highest target among the inputs.
pub fn link(inputs: &[Vec<u8>]) -> Result<Vec<u8>, String> {
    if inputs.is_empty() {
        return Err("nothing to link".into());
    }
    if inputs.len() == 1 {
        return Ok(inputs[0].clone());
    }
    let texts: Vec<&str> = inputs.iter().map(|b| std::str::from_utf8(b).map_err(|_| "PTX input is not UTF-8".to_string())).collect::<Result<_, _>>()?;
    let mut parsed = Vec::new();
    for t in &texts {
        parsed.push(items(t)?);
    }
    // Each defined symbol: a strong definition wins over weak ones, the
    // first weak one over later weak ones; two strong ones are an error.
    let mut defined: std::collections::HashMap<String, (usize, usize, bool)> = std::collections::HashMap::new();
    for (m, (_, its)) in parsed.iter().enumerate() {
        for (k, it) in its.iter().enumerate().filter(|(_, i)| i.defines) {
            let Some(n) = &it.name else { continue };
            let weak = it.text.split_whitespace().any(|w| w == ".weak");
            match defined.get(n) {
                Some(&(_, _, false)) if !weak => return Err(format!("symbol {n} is defined twice")),
                Some(&(_, _, true)) if !weak => {
                    defined.insert(n.clone(), (m, k, false));
                }
                Some(_) => {}
                None => {
                    defined.insert(n.clone(), (m, k, weak));
                }
            }
        }
    }
    let headers: Vec<&str> = parsed.iter().flat_map(|(h, _)| h.iter().copied()).collect();
    let ver = headers.iter().filter(|l| l.starts_with(".version")).map(|l| version(l)).max().unwrap_or((7, 0));
    // The newest target, its suffix kept (at one architecture a suffixed
    // input wins: the merged code holds its specific instructions).
    let target = headers.iter().filter(|l| l.starts_with(".target")).filter_map(|l| target_word(l)).max_by_key(|(a, w)| (*a, w.len())).map_or("sm_52", |(_, w)| w);
    let mut out = format!(".version {}.{}\n.target {target}\n.address_size 64\n\n", ver.0, ver.1);
    let mut declared = std::collections::HashSet::new();
    for (m, (_, its)) in parsed.iter().enumerate() {
        for (k, it) in its.iter().enumerate() {
            let name = it.name.clone();
            let chosen = name.as_ref().and_then(|n| defined.get(n));
            if it.defines && chosen.is_some_and(|&(cm, ck, _)| (cm, ck) != (m, k)) {
                // A definition that lost to another (weak ones).
                continue;
            }
            let resolved = chosen.is_some();
            if !it.defines && (it.external && resolved || name.as_ref().is_some_and(|n| !declared.insert(n.clone()) && !resolved)) {
                continue;
            }
            out.push_str(it.text.trim());
            out.push_str("\n\n");
        }
    }
    Ok(out.into_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAIN: &str = ".version 7.8\n.target sm_52\n.address_size 64\n\n.extern .func (.param .b32 func_retval0) twice\n(\n\t.param .b32 twice_param_0\n)\n;\n.visible .entry k(\n\t.param .u64 k_param_0\n)\n{\n\tret;\n}\n";
    const LIB: &str = ".version 8.0\n.target sm_80\n.address_size 64\n// a helper\n.visible .func (.param .b32 func_retval0) twice(\n\t.param .b32 twice_param_0\n)\n{\n\tret;\n}\n.global .align 4 .u32 counter = 7;\n";

    #[test]
    fn resolves_externs_and_keeps_definitions() {
        let out = String::from_utf8(link(&[MAIN.as_bytes().to_vec(), LIB.as_bytes().to_vec()]).unwrap()).unwrap();
        assert!(out.starts_with(".version 8.0\n.target sm_80\n"), "{out}");
        assert!(!out.contains(".extern"), "{out}");
        assert_eq!(out.matches(".visible .func").count(), 1);
        assert_eq!(out.matches(".visible .entry k").count(), 1);
        assert!(out.contains(".global .align 4 .u32 counter = 7;"));
    }

    #[test]
    fn refuses_double_definitions_and_bad_text() {
        let e = link(&[LIB.as_bytes().to_vec(), LIB.as_bytes().to_vec()]).unwrap_err();
        assert!(e.contains("defined twice"), "{e}");
        assert!(link(&[MAIN.as_bytes().to_vec(), b"{ unbalanced".to_vec()]).is_err());
        assert!(link(&[]).is_err());
    }

    #[test]
    fn a_strong_definition_wins_over_weak_ones() {
        let weak = ".version 8.0\n.target sm_80\n.address_size 64\n.weak .func (.param .b32 func_retval0) twice(\n\t.param .b32 twice_param_0\n)\n{\n\tret;\n}\n";
        let out = String::from_utf8(link(&[weak.as_bytes().to_vec(), MAIN.as_bytes().to_vec(), LIB.as_bytes().to_vec(), weak.as_bytes().to_vec()]).unwrap()).unwrap();
        assert_eq!(out.matches("func_retval0) twice(").count(), 1, "{out}");
        assert!(out.contains(".visible .func (.param .b32 func_retval0) twice("), "{out}");
        assert!(!out.contains(".weak"), "{out}");
    }

    #[test]
    fn the_newest_target_keeps_its_suffix() {
        let specific = LIB.replace(".target sm_80", ".target sm_90a");
        let out = String::from_utf8(link(&[MAIN.as_bytes().to_vec(), specific.into_bytes()]).unwrap()).unwrap();
        assert!(out.contains("\n.target sm_90a\n"), "{out}");
        assert_eq!(target_arch(".target sm_90a"), 90);
        assert_eq!(target_arch(".target sm_100f, debug"), 100);
        assert_eq!(target_arch(".target compute_80"), 0);
    }

    #[test]
    fn names() {
        assert_eq!(fn_name(".visible .func (.param .b32 r) twice(.param .b32 a)").as_deref(), Some("twice"));
        assert_eq!(fn_name(".visible .entry k(").as_deref(), Some("k"));
        assert_eq!(var_name(".global .align 8 .b8 table[16] = {1};").as_deref(), Some("table"));
    }
}
