//! `GET /files` (a file's bytes) and `POST /files` (`multipart/form-data`
//! with a part `file` per file, its filename the path unless `?path=` is
//! given, or `application/octet-stream` with `?path=`). Files are opened
//! inside the main container as the user (`?username=`, else the
//! `Authorization` user, else the default), parent directories made as that
//! user, then streamed from or to the socket by the connection's thread:
//! nothing is held in memory whole. Uploads are capped at
//! [`MAX_UPLOAD_BYTES`] a request.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use super::filesystem::{caller_context, resolve};
use super::http::{self, Body, Request};
use super::sandbox::in_container;
use super::Shared;

/// The largest upload one request may carry.
pub const MAX_UPLOAD_BYTES: u64 = 1 << 30;
/// The largest header block of a multipart part.
const MAX_PART_HEAD: usize = 16 << 10;
/// The most files one multipart upload may carry.
const MAX_PARTS: usize = 1024;

/// A `/files` failure: status and message, answered as `{message, code}`.
#[derive(Debug, thiserror::Error)]
#[error("{status}: {message}")]
pub struct FilesError {
    /// The HTTP status.
    pub status: u16,
    /// What went wrong.
    pub message: String,
}

impl FilesError {
    fn new(status: u16, message: impl Into<String>) -> Self {
        FilesError {
            status,
            message: message.into(),
        }
    }

    /// The JSON body.
    pub fn body(&self) -> Vec<u8> {
        json!({"message": self.message, "code": self.status})
            .to_string()
            .into_bytes()
    }
}

impl From<super::connect::RpcError> for FilesError {
    fn from(e: super::connect::RpcError) -> Self {
        use super::connect::Code;
        let status = match e.code {
            Code::Unauthenticated => 401,
            Code::FailedPrecondition => 503,
            c => c.http_status(),
        };
        FilesError::new(status, e.message)
    }
}

fn io_error(what: &Path, e: &io::Error) -> FilesError {
    FilesError::from(super::connect::RpcError::io(what.display(), e))
}

fn user_of(req: &Request) -> Result<Option<String>, FilesError> {
    match req.query("username").filter(|u| !u.is_empty()) {
        Some(u) => Ok(Some(u.to_string())),
        None => Ok(super::sandbox::user_from_auth(req.header("authorization"))?),
    }
}

/// `GET /files`: writes the response (or returns the error to answer).
pub fn get(shared: &Shared, req: &Request, w: &mut impl Write) -> Result<(), FilesError> {
    let path = req
        .query("path")
        .ok_or_else(|| FilesError::new(400, "the path parameter is missing"))?;
    let user = user_of(req)?;
    let (target, user) = caller_context(shared, user.as_deref())?;
    let (file, path, len) = in_container(&target, Some(&user), || {
        let path = resolve(path, &user.home)?;
        let f = File::open(&path).map_err(|e| super::connect::RpcError::io(path.display(), &e))?;
        let meta = f
            .metadata()
            .map_err(|e| super::connect::RpcError::io(path.display(), &e))?;
        if meta.is_dir() {
            return Err(super::connect::RpcError::invalid(format!(
                "{} is a directory",
                path.display()
            )));
        }
        Ok((f, path, meta.len()))
    })?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().replace(['"', '\\', '\r', '\n'], "_"))
        .unwrap_or_default();
    let disposition = format!("inline; filename=\"{name}\"");
    http::write_head(
        w,
        200,
        &[
            ("Content-Type", "application/octet-stream"),
            ("Content-Disposition", &disposition),
        ],
        Some(len),
        req.keep_alive,
    )
    .map_err(|e| io_error(&path, &e))?;
    // The length was announced: send exactly that much (a file that
    // shrank meanwhile cuts the connection short).
    let sent = io::copy(&mut file.take(len), w).map_err(|e| io_error(&path, &e))?;
    if sent < len {
        return Err(FilesError::new(
            0,
            format!("{} shrank while being sent", path.display()),
        ));
    }
    w.flush().map_err(|e| io_error(&path, &e))
}

/// Opens `path` for writing inside the container as the user, its parents
/// made; returns the file and the absolute path.
fn create(
    target_user: &(super::sandbox::Target, super::sandbox::User),
    path: &str,
) -> Result<(File, PathBuf), FilesError> {
    let (target, user) = target_user;
    Ok(in_container(target, Some(user), || {
        let path = resolve(path, &user.home)?;
        if let Some(parent) = path.parent() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o755)
                .create(parent)
                .map_err(|e| super::connect::RpcError::io(parent.display(), &e))?;
        }
        let f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o644)
            .open(&path)
            .map_err(|e| super::connect::RpcError::io(path.display(), &e))?;
        Ok((f, path))
    })?)
}

fn written(path: &Path) -> Value {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    json!({"name": name, "type": "file", "path": path.to_string_lossy()})
}

/// `POST /files`: the JSON array of the files written.
pub fn post<S: Read + Write>(
    shared: &Shared,
    req: &Request,
    body: Body<'_, S>,
) -> Result<Vec<u8>, FilesError> {
    let user = user_of(req)?;
    let ctx = caller_context(shared, user.as_deref())?;
    let media = req.media_type();
    let mut done = Vec::new();
    if media == "multipart/form-data" {
        let boundary = boundary_of(req.header("content-type").unwrap_or(""))?;
        let mut mp = Multipart::new(body, &boundary);
        while let Some(part) = mp.next_part()? {
            if part.name != "file" {
                mp.copy_part(&mut io::sink())?;
                continue;
            }
            if done.len() >= MAX_PARTS {
                return Err(FilesError::new(400, format!("over {MAX_PARTS} files")));
            }
            let path = match (req.query("path"), part.filename.as_deref()) {
                (Some(p), _) if !p.is_empty() => p.to_string(),
                (_, Some(f)) if !f.is_empty() => f.to_string(),
                _ => return Err(FilesError::new(400, "a file part names no path")),
            };
            let (mut file, abs) = create(&ctx, &path)?;
            mp.copy_part(&mut file)?;
            file.sync_data().map_err(|e| io_error(&abs, &e))?;
            done.push(written(&abs));
        }
        // The epilogue: read, so the connection can take the next request.
        mp.finish()?;
    } else {
        if req
            .header("content-encoding")
            .is_some_and(|e| !e.eq_ignore_ascii_case("identity"))
        {
            return Err(FilesError::new(
                415,
                "compressed uploads are not supported: send the bytes as they are",
            ));
        }
        let path = req
            .query("path")
            .filter(|p| !p.is_empty())
            .ok_or_else(|| FilesError::new(400, "the path parameter is missing"))?;
        let (mut file, abs) = create(&ctx, path)?;
        let mut body = body;
        io::copy(&mut body, &mut file).map_err(|e| body_error(&abs, e))?;
        file.sync_data().map_err(|e| io_error(&abs, &e))?;
        done.push(written(&abs));
    }
    if done.is_empty() {
        return Err(FilesError::new(400, "the upload holds no file"));
    }
    Ok(Value::Array(done).to_string().into_bytes())
}

fn body_error(path: &Path, e: io::Error) -> FilesError {
    match e.kind() {
        io::ErrorKind::InvalidData => {
            FilesError::new(413, format!("{}: the upload: {e}", path.display()))
        }
        _ => io_error(path, &e),
    }
}

/// The `boundary` parameter of a multipart Content-Type.
pub fn boundary_of(content_type: &str) -> Result<String, FilesError> {
    for param in content_type.split(';').skip(1) {
        let Some((k, v)) = param.split_once('=') else {
            continue;
        };
        if k.trim().eq_ignore_ascii_case("boundary") {
            let b = v.trim().trim_matches('"');
            if b.is_empty() || b.len() > 70 {
                return Err(FilesError::new(
                    400,
                    "the multipart boundary is empty or over 70 bytes",
                ));
            }
            return Ok(b.to_string());
        }
    }
    Err(FilesError::new(
        400,
        "the multipart Content-Type has no boundary",
    ))
}

/// A part's head.
#[derive(Debug, PartialEq, Eq)]
pub struct PartHead {
    /// The form field's name.
    pub name: String,
    /// Its filename, if any.
    pub filename: Option<String>,
}

/// A streaming multipart/form-data reader.
pub struct Multipart<R> {
    r: R,
    /// `\r\n--boundary`.
    delim: Vec<u8>,
    buf: Vec<u8>,
    /// Just past a delimiter (a part's head or the end follows).
    at_delim: bool,
    finished: bool,
}

impl<R: Read> Multipart<R> {
    /// A reader of `r` with `boundary`.
    pub fn new(r: R, boundary: &str) -> Self {
        Multipart {
            r,
            delim: format!("\r\n--{boundary}").into_bytes(),
            // The body may start with the first boundary: a CRLF before it
            // makes it a delimiter like the others.
            buf: b"\r\n".to_vec(),
            at_delim: false,
            finished: false,
        }
    }

    fn more(&mut self) -> Result<bool, FilesError> {
        let mut chunk = [0u8; 64 << 10];
        let n = loop {
            match self.r.read(&mut chunk) {
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                    return Err(FilesError::new(413, format!("the upload: {e}")))
                }
                Err(e) => return Err(FilesError::new(400, format!("reading the upload: {e}"))),
            }
        };
        self.buf.extend_from_slice(&chunk[..n]);
        Ok(n > 0)
    }

    /// Reads (and drops) whatever follows the closing delimiter.
    pub fn finish(mut self) -> Result<(), FilesError> {
        self.buf.clear();
        while self.more()? {
            self.buf.clear();
        }
        Ok(())
    }

    /// Copies the current part's data (up to the next delimiter) to `out`.
    pub fn copy_part(&mut self, out: &mut impl Write) -> Result<(), FilesError> {
        self.copy_until_delim(Some(out))
    }

    fn copy_until_delim(&mut self, mut out: Option<&mut impl Write>) -> Result<(), FilesError> {
        loop {
            if let Some(i) = find(&self.buf, &self.delim) {
                if let Some(out) = out.as_mut() {
                    out.write_all(&self.buf[..i])
                        .map_err(|e| FilesError::new(500, format!("writing a file: {e}")))?;
                }
                self.buf.drain(..i + self.delim.len());
                self.at_delim = true;
                return Ok(());
            }
            let keep = self.delim.len() - 1;
            if self.buf.len() > keep {
                let n = self.buf.len() - keep;
                if let Some(out) = out.as_mut() {
                    out.write_all(&self.buf[..n])
                        .map_err(|e| FilesError::new(500, format!("writing a file: {e}")))?;
                }
                self.buf.drain(..n);
            }
            if !self.more()? {
                return Err(FilesError::new(
                    400,
                    "the multipart body ends inside a part",
                ));
            }
        }
    }

    /// The next part's head; `None` after the closing delimiter.
    pub fn next_part(&mut self) -> Result<Option<PartHead>, FilesError> {
        if self.finished {
            return Ok(None);
        }
        // Skip the preamble or the rest of an unread part.
        if !self.at_delim {
            self.copy_until_delim(None::<&mut io::Sink>)?;
        }
        while self.buf.len() < 2 {
            if !self.more()? {
                return Err(FilesError::new(
                    400,
                    "the multipart body ends at a delimiter",
                ));
            }
        }
        if self.buf.starts_with(b"--") {
            self.finished = true;
            return Ok(None);
        }
        // Transport padding, then CRLF, then the part's headers.
        let head_end = loop {
            if let Some(i) = find(&self.buf, b"\r\n\r\n") {
                break i;
            }
            if self.buf.len() > MAX_PART_HEAD {
                return Err(FilesError::new(
                    400,
                    "a multipart part's headers are too long",
                ));
            }
            if !self.more()? {
                return Err(FilesError::new(
                    400,
                    "the multipart body ends in a part's headers",
                ));
            }
        };
        let head = String::from_utf8_lossy(&self.buf[..head_end]).into_owned();
        self.buf.drain(..head_end + 4);
        self.at_delim = false;
        let mut lines = head.split("\r\n");
        if !lines.next().unwrap_or("").trim().is_empty() {
            return Err(FilesError::new(400, "garbage after a multipart delimiter"));
        }
        let disposition = lines
            .filter_map(|l| l.split_once(':'))
            .find(|(k, _)| k.trim().eq_ignore_ascii_case("content-disposition"))
            .map(|(_, v)| v.to_string())
            .ok_or_else(|| FilesError::new(400, "a multipart part has no Content-Disposition"))?;
        Ok(Some(PartHead {
            name: disposition_param(&disposition, "name").unwrap_or_default(),
            filename: disposition_param(&disposition, "filename"),
        }))
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// A parameter of a Content-Disposition value (quoted-string or token).
fn disposition_param(value: &str, key: &str) -> Option<String> {
    let mut rest = value.split_once(';')?.1;
    loop {
        rest = rest.trim_start_matches([' ', '\t', ';']);
        let (k, after) = rest.split_once('=')?;
        let after = after.trim_start();
        let (v, next) = if let Some(q) = after.strip_prefix('"') {
            let mut out = String::new();
            let mut chars = q.char_indices();
            let mut end = q.len();
            while let Some((i, c)) = chars.next() {
                match c {
                    '\\' => {
                        if let Some((_, n)) = chars.next() {
                            out.push(n);
                        }
                    }
                    '"' => {
                        end = i + 1;
                        break;
                    }
                    c => out.push(c),
                }
            }
            (out, &q[end.min(q.len())..])
        } else {
            let end = after.find(';').unwrap_or(after.len());
            (after[..end].trim().to_string(), &after[end..])
        };
        if k.trim().eq_ignore_ascii_case(key) {
            return Some(v);
        }
        rest = next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reader giving `step` bytes at a time.
    struct Slow<'a>(&'a [u8], usize);

    impl Read for Slow<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let n = buf.len().min(self.1).min(self.0.len());
            buf[..n].copy_from_slice(&self.0[..n]);
            self.0 = &self.0[n..];
            Ok(n)
        }
    }

    fn parts(body: &[u8], step: usize) -> Result<Vec<(PartHead, Vec<u8>)>, FilesError> {
        let mut mp = Multipart::new(Slow(body, step), "XyZ");
        let mut out = Vec::new();
        while let Some(head) = mp.next_part()? {
            let mut data = Vec::new();
            mp.copy_part(&mut data)?;
            out.push((head, data));
        }
        mp.finish()?;
        Ok(out)
    }

    #[test]
    fn multipart_parts_stream_at_any_read_size() {
        let body = b"preamble\r\n--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/tmp/a \\\"q\\\".txt\"\r\nContent-Type: application/octet-stream\r\n\r\nhello\r\n--XyQ is not the boundary\r\n--Xy\r\n--XyZ\r\ncontent-disposition: form-data; name=other\r\n\r\nx\r\n--XyZ--\r\nepilogue";
        for step in [1, 2, 7, 100, 1 << 20] {
            let p = parts(body, step).unwrap();
            assert_eq!(p.len(), 2, "step {step}");
            assert_eq!(p[0].0.name, "file");
            assert_eq!(p[0].0.filename.as_deref(), Some("/tmp/a \"q\".txt"));
            assert_eq!(p[0].1, b"hello\r\n--XyQ is not the boundary\r\n--Xy");
            assert_eq!(
                p[1].0,
                PartHead {
                    name: "other".into(),
                    filename: None
                }
            );
            assert_eq!(p[1].1, b"x");
        }
        // The body starting right at the first delimiter, an empty part.
        let p = parts(
            b"--XyZ\r\nContent-Disposition: form-data; name=file; filename=f\r\n\r\n\r\n--XyZ--",
            3,
        )
        .unwrap();
        assert_eq!((p.len(), p[0].1.len()), (1, 0));
    }

    #[test]
    fn hostile_multipart_bodies_are_refused() {
        // Truncated inside a part, in headers, at a delimiter; no
        // disposition; endless headers; garbage after a delimiter.
        for body in [
            &b"--XyZ\r\nContent-Disposition: form-data; name=file\r\n\r\nabc"[..],
            b"--XyZ\r\nContent-Disposition: form-da",
            b"--XyZ",
            b"--XyZ\r\nContent-Type: x\r\n\r\nabc\r\n--XyZ--",
            b"--XyZjunk\r\nContent-Disposition: form-data; name=file\r\n\r\na\r\n--XyZ--",
            b"",
        ] {
            assert!(parts(body, 5).is_err(), "{}", String::from_utf8_lossy(body));
        }
        let mut endless = b"--XyZ\r\n".to_vec();
        endless.extend(std::iter::repeat_n(b'a', MAX_PART_HEAD + 10));
        assert!(parts(&endless, 4096).is_err());
    }

    #[test]
    fn boundaries_and_dispositions() {
        assert_eq!(
            boundary_of("multipart/form-data; boundary=abc").unwrap(),
            "abc"
        );
        assert_eq!(
            boundary_of("multipart/form-data; charset=x; boundary=\"a b\"").unwrap(),
            "a b"
        );
        assert!(boundary_of("multipart/form-data").is_err());
        assert!(boundary_of(&format!("multipart/form-data; boundary={}", "x".repeat(71))).is_err());
        assert_eq!(
            disposition_param("form-data; name=\"file\"; filename=\"a;b\"", "filename").as_deref(),
            Some("a;b")
        );
        assert_eq!(
            disposition_param("form-data; filename=\"unterminated", "filename").as_deref(),
            Some("unterminated")
        );
        assert_eq!(disposition_param("form-data", "name"), None);
        let e = FilesError::new(404, "gone");
        let v: Value = serde_json::from_slice(&e.body()).unwrap();
        assert_eq!(
            (v["code"].clone(), v["message"].clone()),
            (json!(404), json!("gone"))
        );
    }
}
