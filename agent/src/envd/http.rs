//! A small blocking HTTP/1.1 server side on `httparse`: request heads of at
//! most [`MAX_HEAD_BYTES`], bodies by `Content-Length` or chunked (each
//! read against a limit the caller gives), keep-alive, and responses with a
//! length or chunked (a Connect stream). One thread serves a connection;
//! nothing here polls.

use std::io::{self, Read, Write};
use std::net::TcpStream;

/// The largest request head (request line and headers).
pub const MAX_HEAD_BYTES: usize = 64 << 10;
/// The most headers a request may have.
const MAX_HEADERS: usize = 100;
/// The longest chunk-size line (with extensions) of a chunked body.
const MAX_CHUNK_LINE: usize = 4096;
/// The most query parameters a request may have.
const MAX_QUERY_PARAMS: usize = 64;

/// Why a request could not be read.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// The peer closed or reset the connection, or a read timed out.
    #[error("reading the connection: {0}")]
    Io(#[from] io::Error),
    /// The peer closed the connection in the middle of a request.
    #[error("the connection closed in the middle of a request")]
    Truncated,
    /// The request is not valid HTTP/1.x.
    #[error("bad request: {0}")]
    Bad(String),
    /// The request head is larger than [`MAX_HEAD_BYTES`].
    #[error("the request head is over {MAX_HEAD_BYTES} bytes")]
    HeadTooLarge,
    /// The body is larger than the limit of its route.
    #[error("the request body is over {0} bytes")]
    BodyTooLarge(u64),
}

impl HttpError {
    /// The status to answer with before closing, if any.
    pub fn status(&self) -> Option<u16> {
        match self {
            HttpError::Io(_) | HttpError::Truncated => None,
            HttpError::Bad(_) => Some(400),
            HttpError::HeadTooLarge => Some(431),
            HttpError::BodyTooLarge(_) => Some(413),
        }
    }
}

/// How a request's body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyKind {
    /// `Content-Length` bytes (0: none).
    Length(u64),
    /// `Transfer-Encoding: chunked`.
    Chunked,
}

/// A request's head.
#[derive(Debug)]
pub struct Request {
    /// The method, as sent.
    pub method: String,
    /// The path without the query, percent-decoded.
    pub path: String,
    /// The query parameters, decoded, in order.
    pub query: Vec<(String, String)>,
    /// Headers, names in lowercase.
    pub headers: Vec<(String, String)>,
    /// The connection stays open after the response.
    pub keep_alive: bool,
    /// How the body is delimited.
    pub body: BodyKind,
    expect_continue: bool,
}

impl Request {
    /// The first header `name` (lowercase).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The first query parameter `name`.
    pub fn query(&self, name: &str) -> Option<&str> {
        self.query
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The media type of the body, lowercase, without parameters.
    pub fn media_type(&self) -> String {
        self.header("content-type")
            .unwrap_or("")
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase()
    }
}

/// The server's side of one connection: a read buffer over the stream.
pub struct Conn<S> {
    stream: S,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
}

impl Conn<TcpStream> {
    /// Another handle on the stream, to write responses with.
    pub fn writer(&self) -> io::Result<TcpStream> {
        self.stream.try_clone()
    }
}

impl<S: Read + Write> Conn<S> {
    /// A connection over `stream`.
    pub fn new(stream: S) -> Self {
        Conn {
            stream,
            buf: vec![0u8; MAX_HEAD_BYTES].into_boxed_slice(),
            start: 0,
            end: 0,
        }
    }

    /// The stream (tests look at what was written).
    #[cfg(test)]
    pub fn stream(&mut self) -> &mut S {
        &mut self.stream
    }

    fn fill(&mut self) -> io::Result<usize> {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
        if self.end == self.buf.len() {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        loop {
            match self.stream.read(&mut self.buf[self.end..]) {
                Ok(n) => {
                    self.end += n;
                    return Ok(n);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    fn read_some(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if self.start == self.end && self.fill()? == 0 {
            return Ok(0);
        }
        let n = out.len().min(self.end - self.start);
        out[..n].copy_from_slice(&self.buf[self.start..self.start + n]);
        self.start += n;
        Ok(n)
    }

    /// Reads the next request's head; `None` when the peer closed the
    /// connection between requests.
    pub fn read_request(&mut self) -> Result<Option<Request>, HttpError> {
        loop {
            if self.start < self.end {
                let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
                let mut req = httparse::Request::new(&mut headers);
                match req.parse(&self.buf[self.start..self.end]) {
                    Ok(httparse::Status::Complete(n)) => {
                        let head = parse_head(&req)?;
                        self.start += n;
                        return Ok(Some(head));
                    }
                    Ok(httparse::Status::Partial) => {}
                    Err(e) => return Err(HttpError::Bad(e.to_string())),
                }
                if self.end - self.start >= self.buf.len() {
                    return Err(HttpError::HeadTooLarge);
                }
            }
            if self.fill()? == 0 {
                return match self.start == self.end {
                    true => Ok(None),
                    false => Err(HttpError::Truncated),
                };
            }
        }
    }

    /// The body of `req`, refused if it is over `limit` bytes (checked
    /// before anything is read when a length is given, as it is read
    /// otherwise). Answers `Expect: 100-continue` first.
    pub fn body(&mut self, req: &Request, limit: u64) -> Result<Body<'_, S>, HttpError> {
        let state = match req.body {
            BodyKind::Length(n) if n > limit => return Err(HttpError::BodyTooLarge(limit)),
            BodyKind::Length(0) => BodyState::Done,
            BodyKind::Length(n) => BodyState::Length(n),
            BodyKind::Chunked => BodyState::ChunkStart,
        };
        if req.expect_continue && state != BodyState::Done {
            self.stream.write_all(b"HTTP/1.1 100 Continue\r\n\r\n")?;
        }
        Ok(Body {
            conn: self,
            state,
            limit,
            total: 0,
        })
    }

    fn read_line(&mut self) -> Result<Vec<u8>, HttpError> {
        let mut line = Vec::new();
        loop {
            if self.start == self.end && self.fill()? == 0 {
                return Err(HttpError::Truncated);
            }
            let avail = &self.buf[self.start..self.end];
            match avail.iter().position(|&b| b == b'\n') {
                Some(i) => {
                    line.extend_from_slice(&avail[..i]);
                    self.start += i + 1;
                    if line.last() == Some(&b'\r') {
                        line.pop();
                    }
                    return Ok(line);
                }
                None => {
                    line.extend_from_slice(avail);
                    self.start = self.end;
                }
            }
            if line.len() > MAX_CHUNK_LINE {
                return Err(HttpError::Bad("a chunk line is too long".into()));
            }
        }
    }
}

fn parse_head(req: &httparse::Request<'_, '_>) -> Result<Request, HttpError> {
    let method = req.method.unwrap_or_default().to_string();
    let target = req.path.unwrap_or_default();
    let version = req.version.unwrap_or(0);
    let (path, query) = match target.split_once('?') {
        Some((p, q)) => (p, q),
        None => (target, ""),
    };
    if !path.starts_with('/') {
        return Err(HttpError::Bad(format!(
            "the target {target:?} is not a path"
        )));
    }
    let mut headers = Vec::with_capacity(req.headers.len());
    for h in req.headers.iter() {
        let value = std::str::from_utf8(h.value)
            .map_err(|_| HttpError::Bad(format!("header {} is not UTF-8", h.name)))?;
        headers.push((h.name.to_ascii_lowercase(), value.trim().to_string()));
    }
    let mut length: Option<u64> = None;
    for v in find_all(&headers, "content-length") {
        let n: u64 = v
            .parse()
            .map_err(|_| HttpError::Bad(format!("Content-Length {v:?}")))?;
        if length.is_some_and(|l| l != n) {
            return Err(HttpError::Bad("two different Content-Lengths".into()));
        }
        length = Some(n);
    }
    let codings: Vec<String> = find_all(&headers, "transfer-encoding")
        .flat_map(|v| v.split(','))
        .map(|c| c.trim().to_ascii_lowercase())
        .filter(|c| !c.is_empty())
        .collect();
    let body = match (codings.as_slice(), length) {
        ([], n) => BodyKind::Length(n.unwrap_or(0)),
        (_, Some(_)) => {
            return Err(HttpError::Bad(
                "both Transfer-Encoding and Content-Length".into(),
            ))
        }
        ([c], None) if c == "chunked" => BodyKind::Chunked,
        (other, None) => {
            return Err(HttpError::Bad(format!(
                "transfer codings {other:?} (only chunked is supported)"
            )))
        }
    };
    let connection = find_all(&headers, "connection")
        .flat_map(|v| v.split(','))
        .map(|t| t.trim().to_ascii_lowercase())
        .collect::<Vec<_>>();
    let keep_alive = match version {
        1 => !connection.iter().any(|t| t == "close"),
        _ => connection.iter().any(|t| t == "keep-alive"),
    };
    let expect_continue =
        find_all(&headers, "expect").any(|v| v.eq_ignore_ascii_case("100-continue"));
    let query = parse_query(query)?;
    Ok(Request {
        method,
        path: percent_decode(path),
        query,
        headers,
        keep_alive,
        body,
        expect_continue,
    })
}

/// The values of every header `name`.
fn find_all<'a>(
    headers: &'a [(String, String)],
    name: &'a str,
) -> impl Iterator<Item = &'a str> + 'a {
    headers
        .iter()
        .filter(move |(n, _)| n == name)
        .map(|(_, v)| v.as_str())
}

/// `a=b&c=d`, decoded (`+` is a space); at most [`MAX_QUERY_PARAMS`].
pub fn parse_query(q: &str) -> Result<Vec<(String, String)>, HttpError> {
    let pairs: Vec<(String, String)> = q
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (
                percent_decode(&k.replace('+', " ")),
                percent_decode(&v.replace('+', " ")),
            )
        })
        .collect();
    if pairs.len() > MAX_QUERY_PARAMS {
        return Err(HttpError::Bad(format!(
            "over {MAX_QUERY_PARAMS} query parameters"
        )));
    }
    Ok(pairs)
}

/// Decodes `%XX` escapes (a malformed escape stays as it is).
pub fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        match (b[i], b.get(i + 1).copied(), b.get(i + 2).copied()) {
            (b'%', Some(h), Some(l)) if hex(h).is_some() && hex(l).is_some() => {
                let v = hex(h).unwrap_or(0) * 16 + hex(l).unwrap_or(0);
                out.push(u8::try_from(v).unwrap_or(b'?'));
                i += 3;
            }
            (c, _, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BodyState {
    Length(u64),
    ChunkStart,
    ChunkData(u64),
    Done,
}

/// A request body being read; [`Read`] gives its bytes (chunked decoded).
/// Reading past its limit fails with `InvalidData` naming the limit.
pub struct Body<'a, S> {
    conn: &'a mut Conn<S>,
    state: BodyState,
    limit: u64,
    total: u64,
}

impl<S: Read + Write> Body<'_, S> {
    /// The whole body (bounded by the limit).
    pub fn read_all(mut self) -> Result<Vec<u8>, HttpError> {
        let mut out = Vec::new();
        let mut chunk = [0u8; 16 << 10];
        loop {
            let n = self.read_inner(&mut chunk)?;
            if n == 0 {
                return Ok(out);
            }
            out.extend_from_slice(&chunk[..n]);
        }
    }

    fn read_inner(&mut self, out: &mut [u8]) -> Result<usize, HttpError> {
        loop {
            match self.state {
                BodyState::Done => return Ok(0),
                BodyState::Length(left) | BodyState::ChunkData(left) => {
                    let want = out.len().min(usize::try_from(left).unwrap_or(usize::MAX));
                    if want == 0 {
                        return Ok(0);
                    }
                    let n = self.conn.read_some(&mut out[..want])?;
                    if n == 0 {
                        return Err(HttpError::Truncated);
                    }
                    let left = left - n as u64;
                    self.total += n as u64;
                    if self.total > self.limit {
                        return Err(HttpError::BodyTooLarge(self.limit));
                    }
                    self.state = match (self.state, left) {
                        (BodyState::Length(_), 0) => BodyState::Done,
                        (BodyState::Length(_), l) => BodyState::Length(l),
                        (_, 0) => {
                            if !self.conn.read_line()?.is_empty() {
                                return Err(HttpError::Bad(
                                    "a chunk is longer than its size".into(),
                                ));
                            }
                            BodyState::ChunkStart
                        }
                        (_, l) => BodyState::ChunkData(l),
                    };
                    return Ok(n);
                }
                BodyState::ChunkStart => {
                    let line = self.conn.read_line()?;
                    let size = parse_chunk_size(&line)?;
                    if size == 0 {
                        // Trailers, up to the empty line.
                        let mut trailers = 0;
                        while !self.conn.read_line()?.is_empty() {
                            trailers += 1;
                            if trailers > MAX_HEADERS {
                                return Err(HttpError::Bad("too many trailers".into()));
                            }
                        }
                        self.state = BodyState::Done;
                    } else if self.total.saturating_add(size) > self.limit {
                        return Err(HttpError::BodyTooLarge(self.limit));
                    } else {
                        self.state = BodyState::ChunkData(size);
                    }
                }
            }
        }
    }
}

impl<S: Read + Write> Read for Body<'_, S> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        self.read_inner(out).map_err(|e| match e {
            HttpError::Io(e) => e,
            other => io::Error::new(io::ErrorKind::InvalidData, other),
        })
    }
}

fn parse_chunk_size(line: &[u8]) -> Result<u64, HttpError> {
    let line = std::str::from_utf8(line).map_err(|_| HttpError::Bad("a chunk size".into()))?;
    let hex = line.split(';').next().unwrap_or("").trim();
    if hex.is_empty() || hex.len() > 15 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(HttpError::Bad(format!("chunk size {hex:?}")));
    }
    u64::from_str_radix(hex, 16).map_err(|_| HttpError::Bad(format!("chunk size {hex:?}")))
}

fn reason(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        200 => "OK",
        204 => "No Content",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        409 => "Conflict",
        413 => "Content Too Large",
        415 => "Unsupported Media Type",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        499 => "Client Closed Request",
        501 => "Not Implemented",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "Internal Server Error",
    }
}

/// A response head. `length`: `Some(n)` for a body of n bytes, `None` for
/// a chunked one.
pub fn write_head(
    w: &mut impl Write,
    status: u16,
    headers: &[(&str, &str)],
    length: Option<u64>,
    keep_alive: bool,
) -> io::Result<()> {
    let mut head = format!("HTTP/1.1 {status} {}\r\n", reason(status));
    for (n, v) in headers {
        head.push_str(&format!("{n}: {v}\r\n"));
    }
    match length {
        Some(n) if status != 204 => head.push_str(&format!("Content-Length: {n}\r\n")),
        Some(_) => {}
        None => head.push_str("Transfer-Encoding: chunked\r\n"),
    }
    if !keep_alive {
        head.push_str("Connection: close\r\n");
    }
    head.push_str("\r\n");
    w.write_all(head.as_bytes())
}

/// A whole response with `body`.
pub fn respond(
    w: &mut impl Write,
    status: u16,
    content_type: &str,
    body: &[u8],
    keep_alive: bool,
) -> io::Result<()> {
    let headers: &[(&str, &str)] = if body.is_empty() {
        &[]
    } else {
        &[("Content-Type", content_type)]
    };
    write_head(w, status, headers, Some(body.len() as u64), keep_alive)?;
    w.write_all(body)?;
    w.flush()
}

/// One chunk of a chunked response (empty data writes nothing: an empty
/// chunk would end the body).
pub fn write_chunk(w: &mut impl Write, data: &[u8]) -> io::Result<()> {
    if data.is_empty() {
        return Ok(());
    }
    w.write_all(format!("{:x}\r\n", data.len()).as_bytes())?;
    w.write_all(data)?;
    w.write_all(b"\r\n")?;
    w.flush()
}

/// Ends a chunked response.
pub fn finish_chunks(w: &mut impl Write) -> io::Result<()> {
    w.write_all(b"0\r\n\r\n")?;
    w.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream of fixed input whose output is collected.
    struct Fake {
        input: io::Cursor<Vec<u8>>,
        output: Vec<u8>,
        /// Bytes per read, to split requests at odd places.
        step: usize,
    }

    impl Read for Fake {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let n = buf.len().min(self.step);
            self.input.read(&mut buf[..n])
        }
    }

    impl Write for Fake {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.output.extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    fn conn(input: &[u8], step: usize) -> Conn<Fake> {
        Conn::new(Fake {
            input: io::Cursor::new(input.to_vec()),
            output: Vec::new(),
            step,
        })
    }

    #[test]
    fn keep_alive_requests_with_length_and_chunked_bodies() {
        for step in [1, 3, 4096] {
            let mut c = conn(
                b"POST /a%20b?path=%2Ftmp%2Fx+y&n=1 HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n\r\nhello\
                  POST /c HTTP/1.1\r\nTransfer-Encoding: chunked\r\nExpect: 100-continue\r\n\r\n\
                  3;ext=1\r\nabc\r\n2\r\nde\r\n0\r\nTrailer: x\r\n\r\n\
                  GET /h HTTP/1.1\r\nConnection: close\r\n\r\n",
                step,
            );
            let r = c.read_request().unwrap().unwrap();
            assert_eq!((r.method.as_str(), r.path.as_str()), ("POST", "/a b"));
            assert_eq!(r.query("path"), Some("/tmp/x y"));
            assert_eq!(r.header("host"), Some("h"));
            assert!(r.keep_alive);
            assert_eq!(c.body(&r, 10).unwrap().read_all().unwrap(), b"hello");
            let r = c.read_request().unwrap().unwrap();
            assert_eq!(r.body, BodyKind::Chunked);
            assert_eq!(c.body(&r, 10).unwrap().read_all().unwrap(), b"abcde");
            assert_eq!(c.stream().output, b"HTTP/1.1 100 Continue\r\n\r\n");
            let r = c.read_request().unwrap().unwrap();
            assert!(!r.keep_alive);
            assert!(c.read_request().unwrap().is_none());
        }
    }

    #[test]
    fn hostile_requests_are_refused() {
        let err = |input: &[u8]| conn(input, 4096).read_request().unwrap_err();
        assert!(matches!(err(b"GARBAGE\r\n\r\n"), HttpError::Bad(_)));
        assert!(matches!(
            err(b"GET / HTTP/1.1\r\nContent-Length: -1\r\n\r\n"),
            HttpError::Bad(_)
        ));
        assert!(matches!(
            err(b"GET / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n"),
            HttpError::Bad(_)
        ));
        assert!(matches!(
            err(b"GET / HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n"),
            HttpError::Bad(_)
        ));
        assert!(matches!(
            err(b"GET / HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"),
            HttpError::Bad(_)
        ));
        assert!(matches!(err(b"GET * HTTP/1.1\r\n\r\n"), HttpError::Bad(_)));
        assert!(matches!(
            err(b"GET / HTTP/1.1\r\nHost"),
            HttpError::Truncated
        ));
        let mut big = b"GET / HTTP/1.1\r\n".to_vec();
        while big.len() <= MAX_HEAD_BYTES {
            big.extend_from_slice(b"X-Pad: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n");
        }
        let e = err(&big);
        assert!(
            matches!(e, HttpError::HeadTooLarge | HttpError::Bad(_)),
            "{e}"
        );
        assert_eq!(HttpError::HeadTooLarge.status(), Some(431));
        let many: String = (0..200).map(|i| format!("H{i}: v\r\n")).collect();
        let e = err(format!("GET / HTTP/1.1\r\n{many}\r\n").as_bytes());
        assert!(matches!(e, HttpError::Bad(_)), "{e}");
    }

    #[test]
    fn hostile_bodies_are_refused() {
        let body_err = |input: &[u8], limit: u64| {
            let mut c = conn(input, 4096);
            let r = c.read_request().unwrap().unwrap();
            match c.body(&r, limit) {
                Err(e) => e,
                Ok(b) => b.read_all().unwrap_err(),
            }
        };
        // Over the limit, by length (before reading) and by chunks.
        assert!(matches!(
            body_err(b"POST / HTTP/1.1\r\nContent-Length: 11\r\n\r\n", 10),
            HttpError::BodyTooLarge(10)
        ));
        assert!(matches!(
            body_err(
                b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n8\r\n12345678\r\n8\r\n12345678\r\n0\r\n\r\n",
                10
            ),
            HttpError::BodyTooLarge(10)
        ));
        // A chunk size that overflows, a non-hex one, a long chunk line.
        for bad in [&b"fffffffffffffffffffff"[..], b"zz", b"-1", b""] {
            let mut input = b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
            input.extend_from_slice(bad);
            input.extend_from_slice(b"\r\n");
            assert!(matches!(body_err(&input, 1 << 30), HttpError::Bad(_)));
        }
        let mut input = b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n1;".to_vec();
        input.extend(std::iter::repeat_n(b'x', 10_000));
        assert!(matches!(body_err(&input, 1 << 30), HttpError::Bad(_)));
        // A chunk longer than its size; a body cut short.
        assert!(matches!(
            body_err(
                b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nab\r\n0\r\n\r\n",
                100
            ),
            HttpError::Bad(_)
        ));
        assert!(matches!(
            body_err(b"POST / HTTP/1.1\r\nContent-Length: 9\r\n\r\nabc", 100),
            HttpError::Truncated
        ));
    }

    #[test]
    fn query_and_percent_decoding() {
        assert_eq!(percent_decode("a%2fb%zz%4"), "a/b%zz%4");
        let q = parse_query("a=1&&b&c=%E2%9C%93").unwrap();
        assert_eq!(
            q,
            vec![
                ("a".into(), "1".into()),
                ("b".into(), "".into()),
                ("c".into(), "✓".into())
            ]
        );
        let many: Vec<String> = (0..100).map(|i| format!("k{i}=v")).collect();
        assert!(parse_query(&many.join("&")).is_err());
    }

    #[test]
    fn responses_are_framed() {
        let mut out = Vec::new();
        respond(&mut out, 404, "application/json", b"{}", false).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
        );
        let mut out = Vec::new();
        write_head(&mut out, 200, &[], None, true).unwrap();
        write_chunk(&mut out, b"hello").unwrap();
        write_chunk(&mut out, b"").unwrap();
        finish_chunks(&mut out).unwrap();
        assert!(String::from_utf8(out)
            .unwrap()
            .ends_with("Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"));
    }
}
