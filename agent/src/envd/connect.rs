//! Connect-RPC's JSON codec as envd's clients speak it: unary calls are a
//! bare JSON body answered with JSON (or an error object with a non-200
//! status); server-streaming calls carry envelopes (`flags: u8`, `len:
//! u32` big-endian, JSON) both ways, ending with an end-stream envelope
//! (flag `0x02`) holding `{}` or `{"error": {...}}` under status 200.

use serde_json::{json, Value};

use crate::error::AgentError;

/// Envelope flag: the message is compressed (never accepted).
pub const FLAG_COMPRESSED: u8 = 0x01;
/// Envelope flag: the end-stream message.
pub const FLAG_END_STREAM: u8 = 0x02;

/// The largest JSON message a request may carry.
pub const MAX_MESSAGE_BYTES: usize = 4 << 20;

/// Connect's error codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    /// `canceled`.
    Canceled,
    /// `invalid_argument`.
    InvalidArgument,
    /// `deadline_exceeded`.
    DeadlineExceeded,
    /// `not_found`.
    NotFound,
    /// `already_exists`.
    AlreadyExists,
    /// `permission_denied`.
    PermissionDenied,
    /// `resource_exhausted`.
    ResourceExhausted,
    /// `failed_precondition`.
    FailedPrecondition,
    /// `unimplemented`.
    Unimplemented,
    /// `internal`.
    Internal,
    /// `unauthenticated`.
    Unauthenticated,
}

impl Code {
    /// The code's name on the wire.
    pub fn name(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// The HTTP status of a unary error with this code (Connect's table).
    pub fn http_status(self) -> u16 {
        match self {
            Code::Canceled => 499,
            Code::InvalidArgument | Code::FailedPrecondition => 400,
            Code::DeadlineExceeded => 504,
            Code::NotFound => 404,
            Code::AlreadyExists => 409,
            Code::PermissionDenied => 403,
            Code::ResourceExhausted => 429,
            Code::Unimplemented => 501,
            Code::Internal => 500,
            Code::Unauthenticated => 401,
        }
    }
}

/// An RPC's failure, as the client sees it.
#[derive(Debug, thiserror::Error)]
#[error("{}: {message}", code.name())]
pub struct RpcError {
    /// Its code.
    pub code: Code,
    /// What went wrong.
    pub message: String,
}

impl RpcError {
    /// An error with `code`.
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        RpcError {
            code,
            message: message.into(),
        }
    }

    /// `invalid_argument`.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(Code::InvalidArgument, message)
    }

    /// `not_found`.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(Code::NotFound, message)
    }

    /// `internal`.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(Code::Internal, message)
    }

    /// The error as Connect's JSON error object.
    pub fn to_json(&self) -> Value {
        json!({"code": self.code.name(), "message": self.message})
    }

    /// An I/O failure on `what`, its code from the errno.
    pub fn io(what: impl std::fmt::Display, e: &std::io::Error) -> Self {
        let code = match e.kind() {
            std::io::ErrorKind::NotFound => Code::NotFound,
            std::io::ErrorKind::AlreadyExists => Code::AlreadyExists,
            std::io::ErrorKind::PermissionDenied => Code::PermissionDenied,
            std::io::ErrorKind::InvalidInput | std::io::ErrorKind::InvalidData => {
                Code::InvalidArgument
            }
            _ => match e.raw_os_error() {
                Some(libc::ENOTDIR | libc::EISDIR | libc::ELOOP | libc::ENAMETOOLONG) => {
                    Code::InvalidArgument
                }
                Some(libc::ENOTEMPTY | libc::EXDEV | libc::EBUSY) => Code::FailedPrecondition,
                Some(libc::ENOSPC | libc::EDQUOT) => Code::ResourceExhausted,
                _ => Code::Internal,
            },
        };
        RpcError::new(code, format!("{what}: {e}"))
    }
}

impl From<AgentError> for RpcError {
    fn from(e: AgentError) -> Self {
        let code = match e {
            AgentError::InvalidArgument(_) => Code::InvalidArgument,
            AgentError::NotFound(_) => Code::NotFound,
            AgentError::AlreadyExists(_) => Code::AlreadyExists,
            AgentError::FailedPrecondition(_) => Code::FailedPrecondition,
            AgentError::Internal(_) => Code::Internal,
        };
        RpcError::new(code, e.to_string())
    }
}

/// One envelope holding `message`.
pub fn envelope(flags: u8, message: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(5 + message.len());
    out.push(flags);
    out.extend_from_slice(
        &u32::try_from(message.len())
            .unwrap_or(u32::MAX)
            .to_be_bytes(),
    );
    out.extend_from_slice(message);
    out
}

/// The end-stream envelope: `{}`, or the error.
pub fn end_stream(error: Option<&RpcError>) -> Vec<u8> {
    let body = match error {
        None => json!({}),
        Some(e) => json!({"error": e.to_json()}),
    };
    envelope(FLAG_END_STREAM, body.to_string().as_bytes())
}

/// The one message of a server-streaming request's body: a single
/// uncompressed envelope that spans the whole body.
pub fn single_message(body: &[u8]) -> Result<&[u8], RpcError> {
    let Some((head, rest)) = body.split_first_chunk::<5>() else {
        return Err(RpcError::invalid(format!(
            "a streaming request is one envelope; got {} bytes",
            body.len()
        )));
    };
    let len = message_len(head)?;
    if rest.len() != len {
        return Err(RpcError::invalid(format!(
            "the envelope says {len} bytes, the body holds {}",
            rest.len()
        )));
    }
    Ok(rest)
}

/// The next message of a client-streaming request's body, as it arrives;
/// `None` once the body ends between envelopes.
pub fn read_message(body: &mut impl std::io::Read) -> Result<Option<Vec<u8>>, RpcError> {
    let mut head = [0u8; 5];
    let mut got = 0;
    while got < head.len() {
        match body.read(&mut head[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(RpcError::invalid("the body ends inside an envelope")),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(RpcError::invalid(format!("reading the request: {e}"))),
        }
    }
    let mut message = vec![0u8; message_len(&head)?];
    body.read_exact(&mut message)
        .map_err(|e| RpcError::invalid(format!("reading a message: {e}")))?;
    Ok(Some(message))
}

/// The length an envelope's header gives its message, checked.
fn message_len(head: &[u8; 5]) -> Result<usize, RpcError> {
    let flags = head[0];
    if flags & FLAG_COMPRESSED != 0 {
        return Err(RpcError::new(
            Code::Unimplemented,
            "compressed messages are not supported",
        ));
    }
    if flags & FLAG_END_STREAM != 0 {
        return Err(RpcError::invalid("a request message flagged end-stream"));
    }
    let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
    if len > MAX_MESSAGE_BYTES {
        return Err(RpcError::new(
            Code::ResourceExhausted,
            format!("a message of {len} bytes is over {MAX_MESSAGE_BYTES}"),
        ));
    }
    Ok(len)
}

/// Decodes a request message (proto3 JSON; unknown fields ignored).
pub fn decode<T: serde::de::DeserializeOwned>(json: &[u8]) -> Result<T, RpcError> {
    let json = if json.is_empty() { &b"{}"[..] } else { json };
    serde_json::from_slice(json).map_err(|e| RpcError::invalid(format!("the request: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelopes_round_trip_and_hostile_ones_are_refused() {
        let e = envelope(0, br#"{"a":1}"#);
        assert_eq!(&e[..5], &[0, 0, 0, 0, 7]);
        assert_eq!(single_message(&e).unwrap(), br#"{"a":1}"#);
        // Short, long, truncated, trailing bytes, compressed, end-stream.
        assert!(single_message(&[0, 0, 0]).is_err());
        assert!(single_message(&[0, 0xff, 0xff, 0xff, 0xff]).is_err());
        assert!(single_message(&[0, 0, 0, 0, 9, b'{']).is_err());
        let mut extra = e.clone();
        extra.push(b'x');
        assert!(single_message(&extra).is_err());
        let c = envelope(FLAG_COMPRESSED, b"{}");
        assert_eq!(single_message(&c).unwrap_err().code, Code::Unimplemented);
        assert!(single_message(&envelope(FLAG_END_STREAM, b"{}")).is_err());
    }

    #[test]
    fn end_stream_carries_the_error() {
        let ok = end_stream(None);
        assert_eq!(ok, [2, 0, 0, 0, 2, b'{', b'}']);
        let err = end_stream(Some(&RpcError::not_found("no such pid")));
        let v: Value = serde_json::from_slice(&err[5..]).unwrap();
        assert_eq!(err[0], FLAG_END_STREAM);
        assert_eq!(v["error"]["code"], "not_found");
        assert_eq!(v["error"]["message"], "no such pid");
    }

    #[test]
    fn errors_map_to_codes_and_statuses() {
        let e: RpcError = AgentError::AlreadyExists("x".into()).into();
        assert_eq!((e.code, e.code.http_status()), (Code::AlreadyExists, 409));
        let io = std::io::Error::from_raw_os_error(libc::ENOENT);
        assert_eq!(RpcError::io("stat", &io).code, Code::NotFound);
        let io = std::io::Error::from_raw_os_error(libc::EACCES);
        assert_eq!(RpcError::io("open", &io).code, Code::PermissionDenied);
        assert!(decode::<Value>(b"").is_ok());
        assert_eq!(
            decode::<Value>(b"{").unwrap_err().code,
            Code::InvalidArgument
        );
    }
}
