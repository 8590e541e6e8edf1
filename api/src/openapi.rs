//! The daemons' OpenAPI documents are generated from their types and
//! routes (utoipa); this renders one the way docs/api/*.yaml hold it.

/// The document as YAML (1.2; no scalar that YAML 1.1 readers take
/// differently), with a header saying where it comes from.
pub fn to_yaml(doc: &utoipa::openapi::OpenApi) -> String {
    let mut value = serde_yaml_ng::to_value(doc).expect("an OpenAPI document is plain data");
    unsigned_formats(&mut value);
    let body = serde_yaml_ng::to_string(&value).expect("YAML values are YAML");
    format!("# Generated from the daemon's API types and routes: do not edit.\n# Regenerate with scripts/api-docs.sh; a test fails while this differs.\n{body}")
}

/// Fails (a test) when the committed document at `path` differs from
/// `generated`, naming the first line that differs; writes it instead when
/// VGPU_WRITE_API_DOCS is set (scripts/api-docs.sh).
pub fn check_committed(generated: &str, path: &str) {
    if std::env::var_os("VGPU_WRITE_API_DOCS").is_some() {
        std::fs::write(path, generated).unwrap_or_else(|e| panic!("writing {path}: {e}"));
        return;
    }
    let committed = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {path}: {e}"));
    if committed == generated {
        return;
    }
    let (line, (want, have)) =
        generated.lines().chain(std::iter::repeat("<end>")).zip(committed.lines().chain(std::iter::repeat("<end>"))).enumerate().find(|(_, (g, c))| g != c).expect("the documents differ");
    panic!("{path} is not what the API's types and routes generate: run scripts/api-docs.sh and commit the result.\nFirst difference, line {}:\n  generated: {want}\n  committed: {have}", line + 1);
}

/// utoipa writes the formats of unsigned integers `u-int32` and `u-int64`;
/// they are written `uint32` and `uint64` (the name OpenAPI tools use for
/// them; a validator that does not know a format ignores it, so an
/// unsigned 64-bit field is not held to a signed one's maximum).
fn unsigned_formats(v: &mut serde_yaml_ng::Value) {
    match v {
        serde_yaml_ng::Value::Mapping(m) => {
            for (k, x) in m.iter_mut() {
                if k.as_str() == Some("format") {
                    if let Some(f) = x.as_str().and_then(|f| f.strip_prefix("u-int")) {
                        *x = serde_yaml_ng::Value::String(format!("uint{f}"));
                    }
                }
                unsigned_formats(x);
            }
        }
        serde_yaml_ng::Value::Sequence(s) => s.iter_mut().for_each(unsigned_formats),
        _ => {}
    }
}
