//! The REST API and vgpuctl: tenant lifecycle, device listing, JSON output,
//! socket permissions, config files, and clear errors for bad input.

use std::os::unix::fs::PermissionsExt;

use serde_json::json;
use vgpu_tests::*;

fn out(mut c: std::process::Command) -> (bool, String) {
    let o = c.output().expect("run");
    (o.status.success(), format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)))
}

#[test]
fn vgpuctl_manages_tenants_and_lists_devices() {
    let m = Mediator::start(&["--cpu-devices", "2", "--device-memory", "128MiB"]);
    let mut c = m.vgpuctl();
    c.args(["tenant", "create", "web", "--memory", "64MiB", "--weight", "3"]);
    let (ok, sock) = out(c);
    assert!(ok, "{sock}");
    let sock = std::path::PathBuf::from(sock.trim());
    assert!(sock.ends_with("tenants/web.sock"));
    let mode = std::fs::metadata(&sock).expect("socket").permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "tenant socket must be 0600");
    // The daemon binds executors' sockets there; others may only reach a
    // socket by its name: no listing, no writing (nor the workers).
    let dir = std::fs::metadata(sock.parent().expect("dir")).expect("dir");
    assert_eq!(dir.permissions().mode() & 0o777, 0o711, "tenants dir mode");
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&dir), 0, "tenants dir belongs to the daemon");

    // A name goes into a request's path: one that is not a name is refused
    // before it reaches the daemon ("web?x" would have deleted web).
    for bad in ["web?x", "web/../batch", "a\r\nX-Evil: 1"] {
        let mut c = m.vgpuctl();
        c.args(["tenant", "delete", bad]);
        let (ok, text) = out(c);
        assert!(!ok && text.contains("is not a name"), "{bad:?}: {text}");
    }
    assert_eq!(m.api("GET", "/tenants/web", None).0, 200, "web is still there");

    // Placement spreads by free memory.
    let mut c = m.vgpuctl();
    c.args(["tenant", "create", "batch", "--memory", "100MiB"]);
    assert!(out(c).0);
    let (_, v) = m.api("GET", "/tenants/batch", None);
    let (_, w) = m.api("GET", "/tenants/web", None);
    assert_ne!(v["device"], w["device"]);

    let mut c = m.vgpuctl();
    c.args(["tenant", "list"]);
    let (ok, text) = out(c);
    assert!(ok && text.contains("web") && text.contains("64MiB") && text.contains("batch"), "{text}");

    let mut c = m.vgpuctl();
    c.args(["-o", "json", "tenant", "show", "web"]);
    let (ok, text) = out(c);
    assert!(ok, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).expect("json");
    assert_eq!(v["memory"], 64u64 << 20);
    assert_eq!(v["weight"], 3);
    assert_eq!(v["usage"]["quota"], 64u64 << 20);

    // What a program needs to run as the tenant, for a shell's eval: the
    // socket and, on a CPU device, CuPy's setting to compile to PTX.
    let mut c = m.vgpuctl();
    c.args(["tenant", "env", "web"]);
    let (ok, text) = out(c);
    assert!(ok, "{text}");
    assert_eq!(text, format!("export VGPU_SOCKET={}\nexport CUPY_COMPILE_WITH_PTX=1\n", sock.display()));
    let mut c = m.vgpuctl();
    c.args(["tenant", "show", "web"]);
    let (ok, text) = out(c);
    assert!(ok && text.contains("env:       CUPY_COMPILE_WITH_PTX=1"), "{text}");
    let mut c = m.vgpuctl();
    c.args(["tenant", "create", "guest", "--memory", "8MiB", "--vm"]);
    assert!(out(c).0);
    let mut c = m.vgpuctl();
    c.args(["tenant", "env", "guest"]);
    let (ok, text) = out(c);
    assert!(!ok && text.contains("is a VM's vGPU") && text.contains("set CUPY_COMPILE_WITH_PTX=1 in the guest"), "{text}");
    assert!(m.api("DELETE", "/tenants/guest", None).0 < 300);

    // Live changes: share, cap, class and quota, seen by the worker too.
    let mut c = m.vgpuctl();
    c.args(["tenant", "set", "web", "--weight", "5", "--cap", "40", "--priority", "latency", "--memory", "32MiB"]);
    let (ok, text) = out(c);
    assert!(ok && text.contains("weight 5, cap 40%, priority latency, quota 32MiB"), "{text}");
    let (_, v) = m.api("GET", "/tenants/web", None);
    assert_eq!((v["weight"].as_u64(), v["cap"].as_u64(), v["priority"].as_str()), (Some(5), Some(40), Some("latency")), "{v}");
    assert_eq!((v["usage"]["quota"].as_u64(), v["usage"]["weight"].as_u64(), v["usage"]["cap"].as_u64()), (Some(32 << 20), Some(5), Some(40)), "the worker has the new values: {v}");
    let mut c = m.vgpuctl();
    c.args(["tenant", "set", "web", "--cap", "100", "--memory", "64MiB"]);
    assert!(out(c).0);
    let (_, v) = m.api("GET", "/tenants/web", None);
    assert!(v.get("cap").is_none() && v["usage"]["cap"].is_null(), "{v}");

    let mut c = m.vgpuctl();
    c.args(["device", "list", "-o", "json"]);
    let (ok, text) = out(c);
    let v: serde_json::Value = serde_json::from_str(&text).expect("json");
    assert!(ok && v.as_array().map(|a| a.len()) == Some(2), "{text}");

    let mut c = m.vgpuctl();
    c.args(["device", "list"]);
    let (ok, text) = out(c);
    assert!(ok && text.contains("cpu1") && text.contains("running"), "{text}");
    // Table mode shows a table (not JSON); an output a verb cannot give is
    // a usage error.
    let mut c = m.vgpuctl();
    c.args(["device", "show", "cpu1"]);
    let (ok, text) = out(c);
    assert!(ok && text.starts_with("name:        cpu1") && !text.contains('{'), "{text}");
    let mut c = m.vgpuctl();
    c.args(["-o", "json", "metrics"]);
    assert_eq!(c.output().expect("vgpuctl").status.code(), Some(2));
    let mut c = m.vgpuctl();
    c.arg("version");
    let (ok, text) = out(c);
    assert!(ok && text.starts_with("vgpuctl ") && text.contains("vgpu-mediatord ") && text.contains("health: ok (2 devices up)"), "{text}");

    // Clear errors.
    for (args, want) in [
        (vec!["tenant", "create", "web", "--memory", "1MiB"], "already exists"),
        (vec!["tenant", "create", "../evil", "--memory", "1MiB"], "\"../evil\" is not a name"),
        (vec!["tenant", "create", "huge", "--memory", "1TiB"], "more than any device in pool default can hold"),
        (vec!["tenant", "create", "odd", "--memory", "12XB"], "invalid size"),
        (vec!["tenant", "show", "nobody"], "no tenant nobody"),
        (vec!["tenant", "delete", "nobody"], "no tenant nobody"),
        (vec!["tenant", "set", "nobody", "--weight", "2"], "no tenant nobody"),
        (vec!["tenant", "set", "web"], "nothing to change"),
        (vec!["tenant", "set", "web", "--weight", "0"], "weight must be 1..=10000"),
        (vec!["tenant", "set", "web", "--cap", "101"], "cap must be a percentage"),
        (vec!["tenant", "set", "web", "--memory", "1TiB"], "holds at most"),
        (vec!["tenant", "create", "capped", "--memory", "1MiB", "--cap", "0"], "cap must be a percentage"),
    ] {
        let mut c = m.vgpuctl();
        c.args(&args);
        let (ok, text) = out(c);
        assert!(!ok && text.contains(want), "{args:?}: {text}");
    }

    // One size grammar: a bad size is a usage error (exit 2) before any
    // request; decimal units and fractions are sizes too.
    let mut c = m.vgpuctl();
    c.args(["tenant", "create", "odd", "--memory", "12XB"]);
    assert_eq!(c.output().expect("vgpuctl").status.code(), Some(2));
    // vgpuctl builds the API's own request types and runs the daemon's own
    // checks on them: a bad request is a usage error (exit 2), in the
    // daemon's words, and never sent.
    for (args, want) in [
        (vec!["tenant", "create", "capped", "--memory", "1MiB", "--cap", "0"], "cap must be a percentage"),
        (vec!["tenant", "create", "own", "--memory", "1MiB", "--owner", "alice"], "is not UID:GID"),
        (vec!["tenant", "create", "mod", "--memory", "1MiB", "--mode", "0066"], "must be octal permission bits"),
        (vec!["tenant", "create", "b@d", "--memory", "1MiB"], "\"b@d\" is not a name"),
        (vec!["tenant", "set", "web", "--weight", "0"], "weight must be 1..=10000"),
        (vec!["pool", "create", "p", "--device", "cpu0", "--device", "cpu0"], "listed twice"),
        (vec!["pool", "set", "p", "--overcommit", "17"], "overcommit must be a ratio"),
    ] {
        let mut c = m.vgpuctl();
        c.args(&args);
        let o = c.output().expect("vgpuctl");
        let text = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.code() == Some(2) && text.contains(want), "{args:?}: exit {:?}: {text}", o.status.code());
    }
    for (size, bytes) in [("1.5MiB", 3u64 << 19), ("2MB", 2_000_000), ("3Mi", 3 << 20)] {
        let name = format!("sz{bytes}");
        let mut c = m.vgpuctl();
        c.args(["tenant", "create", &name, "--memory", size]);
        assert!(out(c).0, "--memory {size}");
        let (_, t) = m.api("GET", &format!("/tenants/{name}"), None);
        assert_eq!(t["memory"].as_u64(), Some(bytes), "--memory {size}: {t}");
        let (st, _) = m.api("DELETE", &format!("/tenants/{name}"), None);
        assert!(st < 300);
    }

    let mut c = m.vgpuctl();
    c.args(["tenant", "delete", "web"]);
    assert!(out(c).0);
    assert!(!sock.exists(), "socket removed with the tenant");
    assert!(std::os::unix::net::UnixStream::connect(&sock).is_err());

    let mut c = m.vgpuctl();
    c.args(["metrics"]);
    let (ok, text) = out(c);
    assert!(ok && text.contains("vgpu_tenant_memory_quota_bytes{tenant=\"batch\""), "{text}");
}

/// Every verb that reads prints JSON and YAML with the same data, a wider
/// table for lists under `-o wide` (the plain table for one object), and
/// metrics refuse both data formats as a usage error.
#[test]
fn every_reading_verb_honours_each_output_format() {
    let m = Mediator::start(&["--cpu-devices", "2", "--device-memory", "128MiB"]);
    let mut c = m.vgpuctl();
    c.args(["tenant", "create", "web", "--memory", "32MiB", "--weight", "3"]);
    assert!(out(c).0);
    let run = |fmt: &str, verb: &[&str]| {
        let mut c = m.vgpuctl();
        c.args(["-o", fmt]).args(verb);
        let o = c.output().expect("vgpuctl");
        assert!(o.status.success(), "-o {fmt} {verb:?}: {}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let lists: [&[&str]; 4] = [&["tenant", "list"], &["device", "list"], &["pool", "list"], &["vm", "list"]];
    let ones: [&[&str]; 5] = [&["tenant", "show", "web"], &["device", "show", "cpu1"], &["pool", "show", "default"], &["usage"], &["version"]];
    for verb in lists.iter().chain(ones.iter()) {
        let json: serde_json::Value = serde_json::from_str(&run("json", verb)).unwrap_or_else(|e| panic!("{verb:?}: -o json is not JSON: {e}"));
        let yaml: serde_json::Value = serde_yaml_ng::from_str(&run("yaml", verb)).unwrap_or_else(|e| panic!("{verb:?}: -o yaml is not YAML: {e}"));
        // The same answer both ways (live figures aside).
        let keys = |v: &serde_json::Value| match v {
            serde_json::Value::Array(a) => a.iter().map(|x| x.get("name").cloned().unwrap_or_default()).collect::<Vec<_>>(),
            serde_json::Value::Object(o) => o.keys().map(|k| serde_json::Value::String(k.clone())).collect(),
            other => vec![other.clone()],
        };
        assert_eq!(keys(&json), keys(&yaml), "{verb:?}: JSON and YAML differ");
    }
    for verb in lists {
        let (table, wide) = (run("table", verb), run("wide", verb));
        let cols = |t: &str| t.lines().next().unwrap_or("").split_whitespace().count();
        assert!(cols(&wide) > cols(&table), "{verb:?}: -o wide has no more columns than the table:\n{table}\n{wide}");
    }
    let wide = run("wide", &["tenant", "list"]);
    assert!(wide.lines().next().is_some_and(|h| h.contains("PRIORITY") && h.contains("OWNER")) && wide.contains("normal"), "{wide}");
    assert_eq!(run("wide", &["tenant", "show", "web"]), run("table", &["tenant", "show", "web"]));
    for fmt in ["json", "yaml"] {
        let mut c = m.vgpuctl();
        c.args(["-o", fmt, "metrics"]);
        assert_eq!(c.output().expect("vgpuctl").status.code(), Some(2), "-o {fmt} metrics");
    }
}

#[test]
fn api_rejects_malformed_requests() {
    let m = Mediator::start(&[]);
    let r = vgpu_api::http::request(&m.api_path(), "POST", "/tenants", Some(b"{not json")).expect("request");
    assert_eq!(r.status, 400);
    let (st, v) = m.api("POST", "/tenants", Some(json!({"name": "x", "memory": "1MiB", "colour": "red"})));
    assert_eq!(st, 400, "{v}");
    let (st, _) = m.api("POST", "/tenants", Some(json!({"name": "x", "memory": 0})));
    assert_eq!(st, 400);
    // A device or pool that does not exist: 404, as the document says.
    for (key, name) in [("device", "gpu9"), ("pool", "nopool")] {
        let (st, v) = m.api("POST", "/tenants", Some(json!({"name": "x", "memory": "1MiB", key: name})));
        assert_eq!(st, 404, "{key} {name}: {v}");
    }
    let (st, _) = m.api("GET", "/nothing", None);
    assert_eq!(st, 404);
    // Refusals made before a handler runs are JSON too: a name that is
    // not UTF-8, a body over the limit (refused from its length alone).
    use std::io::{Read, Write};
    for head in [
        "GET /v1/tenants/%FF HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        "POST /v1/tenants HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 3145728\r\nConnection: close\r\n\r\n",
    ] {
        let mut s = std::os::unix::net::UnixStream::connect(m.api_path()).expect("connect");
        s.write_all(head.as_bytes()).expect("write");
        if head.starts_with("POST") {
            // Sent while the answer is read: the daemon stops reading it
            // past the limit.
            let mut w = s.try_clone().expect("clone");
            std::thread::spawn(move || {
                let _ = w.write_all(&vec![b' '; 3 << 20]);
            });
        }
        s.set_read_timeout(Some(std::time::Duration::from_secs(10))).expect("timeout");
        let mut answer = String::new();
        let _ = s.read_to_string(&mut answer);
        let (top, body) = answer.split_once("\r\n\r\n").unwrap_or_else(|| panic!("{head}: {answer}"));
        assert!(top.starts_with("HTTP/1.1 4") && top.to_ascii_lowercase().contains("content-type: application/json"), "{head}: {answer}");
        let v: serde_json::Value = serde_json::from_str(body.trim()).unwrap_or_else(|e| panic!("{head}: {body} is not JSON ({e})"));
        assert!(v["error"].as_str().is_some_and(|e| !e.is_empty()), "{v}");
    }
}

/// The API is versioned: every path answers under /v1 as at the root, the
/// daemon serves its own OpenAPI document, and refusals there are JSON too.
#[test]
fn the_api_answers_under_v1_and_serves_its_document() {
    let m = Mediator::start(&[]);
    let (st, _) = m.api("POST", "/v1/tenants", Some(json!({"name": "web", "memory": "16MiB"})));
    assert_eq!(st, 201);
    let (st, v1) = m.api("GET", "/v1/tenants/web", None);
    let (_, root) = m.api("GET", "/tenants/web", None);
    assert_eq!((st, v1["name"].as_str(), v1["memory"].as_u64()), (200, Some("web"), root["memory"].as_u64()), "{v1}");
    for path in ["/openapi.yaml", "/v1/openapi.yaml"] {
        let r = vgpu_api::http::request(&m.api_path(), "GET", path, None).expect("request");
        let committed = std::fs::read_to_string(workspace().join("docs/api/mediator.yaml")).expect("the document");
        assert_eq!((r.status, r.text()), (200, committed), "{path} serves the committed document");
    }
    let (st, v) = m.api("GET", "/v1/nothing", None);
    assert!(st == 404 && v["error"].as_str().is_some_and(|e| e.contains("/v1/nothing")), "{v}");
    let (st, v) = m.api("DELETE", "/v1/version", None);
    assert!(st == 405 && v["error"].is_string(), "{v}");
    let (st, _) = m.api("DELETE", "/v1/tenants/web", None);
    assert!(st < 300);
}

#[test]
fn config_file_creates_tenants_and_bad_config_is_refused() {
    let dir = std::env::temp_dir().join(format!("vgpu-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let cfg = dir.join("good.toml");
    std::fs::write(&cfg, "[devices]\ncpu = 1\nmemory = \"96MiB\"\n\n[[tenants]]\nname = \"fromfile\"\nmemory = \"32MiB\"\nweight = 2\n").expect("write");
    let m = Mediator::start(&["--config", cfg.to_str().expect("utf8")]);
    let (st, v) = m.api("GET", "/tenants/fromfile", None);
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["weight"], 2);
    assert_eq!(m.device("cpu0")["memory_total"], 96u64 << 20);
    assert!(run_ok(sample("vectorAdd", std::path::Path::new(v["socket"].as_str().expect("socket")))).contains("PASSED"));

    // A second mediator on the same run dir refuses to start.
    let o = std::process::Command::new(bin("vgpu-mediatord")).arg("--run-dir").arg(&m.run_dir).output().expect("run");
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    let pid = format!("another mediator (pid {})", m.pid());
    assert!(!o.status.success() && err.contains(&pid) && err.contains("run directory"), "{err}");
    // So does one with a run dir of its own but the first's state dir,
    // whose saved tenants and usage records they would both write.
    let o = std::process::Command::new(bin("vgpu-mediatord")).arg("--run-dir").arg(dir.join("rd2")).arg("--state-dir").arg(m.run_dir.join("state")).output().expect("run");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains(&pid) && err.contains("state directory"), "{err}");
    assert!(m.api("GET", "/tenants/fromfile", None).0 == 200, "the first mediator keeps serving");

    for (name, text, want) in [
        ("unknown.toml", "[devices]\ncpus = 2\n", "unknown field"),
        ("size.toml", "[devices]\nmemory = \"lots\"\n", "invalid size"),
        ("name.toml", "[[tenants]]\nname = \"a b\"\nmemory = \"1MiB\"\n", "invalid tenant name"),
        ("pool.toml", "[[pools]]\nname = \"gold\"\ndevices = [\"cpu9\"]\n", "pool gold: no device named cpu9"),
        ("stop.toml", "[vms]\nstop_timeout_s = 9223372036854775807\n", "vms.stop_timeout_s must be 1..=3600"),
        ("private.toml", "[[pools]]\nname = \"gold\"\ndevices = [\"cpu0\"]\n[[tenants]]\nname = \"t\"\nmemory = \"1MiB\"\npool = \"gold\"\naccess = \"x\"\n", "unknown field `access`"),
    ] {
        let p = dir.join(name);
        std::fs::write(&p, text).expect("write");
        let o = std::process::Command::new(bin("vgpu-mediatord")).arg("--run-dir").arg(dir.join("rd")).arg("--config").arg(&p).output().expect("run");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(want), "{name}: {err}");
    }
    let o = std::process::Command::new(bin("vgpu-mediatord")).arg("--run-dir").arg(dir.join("rd")).args(["--device-memory", "12XB"]).output().expect("run");
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("invalid size"));
    // Refused in the flag's words, as the config file's key is (0 once
    // meant the default, silently).
    for size in ["0", "512KiB", "2TiB"] {
        let o = std::process::Command::new(bin("vgpu-mediatord")).arg("--run-dir").arg(dir.join("rd")).args(["--cuda", "off", "--device-memory", size]).output().expect("run");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains("--device-memory must be between 1MiB and 1TiB"), "{size}: {err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn vgpuctl_prints_shell_completions_and_a_manual_page_from_its_definition() {
    let run = |args: &[&str]| {
        let o = std::process::Command::new(vgpu_tests::bin("vgpuctl")).args(args).output().expect("vgpuctl");
        assert!(o.status.success(), "vgpuctl {args:?}: {o:?}");
        String::from_utf8(o.stdout).expect("utf-8")
    };
    let bash = run(&["completions", "bash"]);
    for verb in ["tenant", "pool", "vm", "vmm", "usage"] {
        assert!(bash.contains(verb), "the bash completion lacks {verb}");
    }
    assert!(bash.contains("--vgpu-memory"), "the completion knows vm create's flags");
    let man = run(&["man"]);
    assert!(man.starts_with(".ie") || man.contains(".TH vgpuctl"), "not a roff page: {}", &man[..man.len().min(200)]);
    // Output cut short by a closed pipe ends quietly, as `head` expects.
    for cmd in ["completions bash", "man"] {
        let o = std::process::Command::new("sh").arg("-c").arg(format!("{} {cmd} | head -1", vgpu_tests::bin("vgpuctl").display())).output().expect("sh");
        assert!(o.status.success() && o.stderr.is_empty(), "vgpuctl {cmd} | head -1: {o:?}");
    }
    // Every verb has --help.
    for verb in [&["vm", "create"][..], &["vm", "list"], &["tenant", "set"], &["pool", "create"], &["vmm", "info"]] {
        let mut a = verb.to_vec();
        a.push("--help");
        assert!(run(&a).contains("Usage: vgpuctl"), "{verb:?} --help");
    }
    // A page per verb, and every page another page names exists.
    let dir = std::env::temp_dir().join(format!("vgpuctl-man-{}", std::process::id()));
    let listed = run(&["man", "--dir", dir.to_str().expect("path")]);
    for page in ["vgpuctl.1", "vgpuctl-tenant.1", "vgpuctl-tenant-create.1", "vgpuctl-vm-stop.1", "vgpuctl-apply.1"] {
        assert!(dir.join(page).exists() && listed.contains(page), "{page} was not written:\n{listed}");
    }
    for entry in std::fs::read_dir(&dir).expect("the pages") {
        let path = entry.expect("page").path();
        let text = std::fs::read_to_string(&path).expect("page");
        for named in text.split("vgpuctl\\-").skip(1).filter_map(|rest| rest.split_once("(1)").map(|(n, _)| n.replace("\\-", "-"))) {
            if named.chars().all(|c| c.is_ascii_lowercase() || c == '-') {
                assert!(dir.join(format!("vgpuctl-{named}.1")).exists(), "{} names vgpuctl-{named}(1), which was not written", path.display());
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The daemon holds at most `devices.max_tenants` tenants: a create past
/// it is refused by name, and a delete makes room again.
#[test]
fn tenants_past_the_daemons_most_are_refused() {
    let dir = std::env::temp_dir().join(format!("vgpu-most-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("mkdir");
    let cfg = dir.join("most.toml");
    std::fs::write(&cfg, "[devices]\nmax_tenants = 2\n").expect("write");
    let m = Mediator::start(&["--config", cfg.to_str().unwrap()]);
    for n in ["one", "two"] {
        m.tenant(n, "1MiB");
    }
    let (st, v) = m.api("POST", "/tenants", Some(json!({"name": "three", "memory": "1MiB"})));
    assert!(st == 409 && v["error"].as_str().is_some_and(|e| e.contains("devices.max_tenants")), "{st} {v}");
    let (st, _) = m.api("DELETE", "/tenants/one", None);
    assert!(st == 204 || st == 202);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while m.api("POST", "/tenants", Some(json!({"name": "three", "memory": "1MiB"}))).0 != 201 {
        assert!(std::time::Instant::now() < deadline, "no room after a delete");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    // Lowered below what the daemon holds: the tenants it made come back
    // after a restart, and only new ones are refused.
    let mut m = m;
    std::fs::write(&cfg, "[devices]\nmax_tenants = 1\n").expect("write");
    m.restart_after(libc::SIGTERM, &["--config", cfg.to_str().unwrap()]);
    for n in ["two", "three"] {
        assert_eq!(m.api("GET", &format!("/tenants/{n}"), None).0, 200, "{n} did not come back");
    }
    assert_eq!(m.api("POST", "/tenants", Some(json!({"name": "four", "memory": "1MiB"}))).0, 409);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `vgpuctl apply` twice on the same file changes nothing, whichever way
/// the file spells a value the daemon reads back another way (a mode's
/// digits, a flag left off, a NUMA preference), and a tenant for an
/// operator's own VMM is described as `vm-tenant`.
#[test]
fn applying_the_same_file_again_is_unchanged() {
    let m = Mediator::start(&[]);
    let file = m.run_dir.join("site.yaml");
    std::fs::write(
        &file,
        "kind: tenant\nname: svc\nmemory: 16MiB\nmode: \"660\"\nhidden: false\nnuma_node: 3\nweight: 2\n---\n\
         kind: vm-tenant\nname: guest\nmemory: 16MiB\n",
    )
    .expect("write");
    let apply = || {
        let o = m.vgpuctl().args(["apply", "-f", file.to_str().unwrap()]).output().expect("vgpuctl apply");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    assert_eq!(apply().lines().collect::<Vec<_>>(), ["tenant/svc created", "tenant/guest created"]);
    assert_eq!(m.api("GET", "/tenants/guest", None).1["kind"], "vm");
    assert_eq!(m.api("GET", "/tenants/svc", None).1["mode"], "0660");
    let again = apply();
    assert_eq!(again.lines().collect::<Vec<_>>(), ["tenant/svc unchanged", "tenant/guest unchanged"], "{again}");
}
