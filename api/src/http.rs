//! A minimal HTTP/1.1 client over a unix socket: one request per
//! connection, `Content-Length` or read-to-close bodies. Enough for the
//! mediator's and VMM's JSON APIs without an async runtime in the CLI.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("cannot reach {path}: {err} (is the daemon running?)")]
    Connect { path: String, err: std::io::Error },
    #[error("request failed: {0}")]
    Io(#[from] std::io::Error),
    #[error("malformed response: {0}")]
    Malformed(String),
}

#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub body: Vec<u8>,
}

impl Response {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// How long a request waits for its answer unless it says otherwise.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(60);

pub fn request(socket: &Path, method: &str, path: &str, body: Option<&[u8]>) -> Result<Response, HttpError> {
    request_waiting(socket, method, path, body, DEFAULT_WAIT)
}

/// A request whose answer may take up to `wait` (a VM's stop waits for
/// its guest).
pub fn request_waiting(socket: &Path, method: &str, path: &str, body: Option<&[u8]>, wait: Duration) -> Result<Response, HttpError> {
    let mut s = UnixStream::connect(socket).map_err(|err| HttpError::Connect { path: socket.display().to_string(), err })?;
    s.set_read_timeout(Some(wait))?;
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n");
    if let Some(b) = body {
        req.push_str(&format!("Content-Type: application/json\r\nContent-Length: {}\r\n", b.len()));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes())?;
    if let Some(b) = body {
        s.write_all(b)?;
    }
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    parse(&raw)
}

fn parse(raw: &[u8]) -> Result<Response, HttpError> {
    let end = raw.windows(4).position(|w| w == b"\r\n\r\n").ok_or_else(|| HttpError::Malformed("no header terminator".into()))?;
    let head = std::str::from_utf8(&raw[..end]).map_err(|_| HttpError::Malformed("non-UTF-8 headers".into()))?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or("");
    let status: u16 = status_line.split_whitespace().nth(1).and_then(|s| s.parse().ok()).ok_or_else(|| HttpError::Malformed(format!("bad status line {status_line:?}")))?;
    let mut body = raw[end + 4..].to_vec();
    let mut chunked = false;
    for l in lines {
        if let Some((k, v)) = l.split_once(':') {
            let (k, v) = (k.trim().to_ascii_lowercase(), v.trim());
            if k == "content-length" {
                let n: usize = v.parse().map_err(|_| HttpError::Malformed("bad content-length".into()))?;
                body.truncate(n);
            } else if k == "transfer-encoding" && v.eq_ignore_ascii_case("chunked") {
                chunked = true;
            }
        }
    }
    if chunked {
        body = dechunk(&body)?;
    }
    Ok(Response { status, body })
}

fn dechunk(mut b: &[u8]) -> Result<Vec<u8>, HttpError> {
    let mut out = Vec::new();
    loop {
        let nl = b.windows(2).position(|w| w == b"\r\n").ok_or_else(|| HttpError::Malformed("bad chunk".into()))?;
        let size = usize::from_str_radix(std::str::from_utf8(&b[..nl]).unwrap_or("").trim(), 16).map_err(|_| HttpError::Malformed("bad chunk size".into()))?;
        b = &b[nl + 2..];
        if size == 0 {
            return Ok(out);
        }
        if b.len() < size + 2 {
            return Err(HttpError::Malformed("truncated chunk".into()));
        }
        out.extend_from_slice(&b[..size]);
        b = &b[size + 2..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_length_and_chunked_bodies() {
        let r = parse(b"HTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\n{}xx").unwrap();
        assert_eq!((r.status, r.text().as_str()), (201, "{}"));
        let r = parse(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n").unwrap();
        assert_eq!(r.text(), "abcde");
        assert!(parse(b"garbage").is_err());
    }
}
