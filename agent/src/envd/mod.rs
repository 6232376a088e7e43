//! The sandbox API: an E2B-compatible envd on TCP port 49983 in the pod's
//! network, so that E2B's and CubeSandbox's SDKs run commands and use
//! files in the pod's main container (see `agent/ENVD.md`).
//!
//! Opt-in: for a pod annotated `twig.dev/envd: "true"` it listens from the
//! moment the pod's sandbox container (the built-in pause) starts, in the
//! pause's network namespace, and stops when that container is removed; a
//! VM restored from a snapshot is told its pod's choice in `Reidentify`
//! ([`Policy`]). The socket lives in guest memory: it keeps listening
//! across snapshot, restore, clone and rollback. A thread accepts, a thread
//! serves each connection (at most [`MAX_CONNECTIONS`]), blocking: an idle
//! pod costs nothing.
//!
//! - `http.rs`: HTTP/1.1; `connect.rs`: Connect-RPC's JSON envelopes and
//!   errors; `process.rs`: `process.Process`; `filesystem.rs`, `watch.rs`:
//!   `filesystem.Filesystem`; `files.rs`: `/files`; `sandbox.rs`: the main
//!   container, users, file operations inside the container.
//! - `GET /health` (204, never needs the token), `POST /init` (JSON
//!   `accessToken`, `envVars`, `defaultUser`, `defaultWorkdir`; 204).
//!   Once a token is set (by `/init`, or from the start by the pod's
//!   `twig.dev/envd-token-sha256`), every other request needs an
//!   `X-Access-Token` whose SHA-256 is the token's (compared in constant
//!   time), `/init` included. Only the digest is kept.

mod connect;
mod files;
mod filesystem;
mod http;
mod process;
mod sandbox;
mod watch;

use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sched::{setns, CloneFlags};
use oci_spec::runtime::Spec;
use serde::Deserialize;
use serde_json::Value;

use self::connect::{Code, RpcError};
use self::http::{Conn, HttpError, Request};
use crate::container::Registry;
use crate::reaper::{lock, Reaper};

/// The most connections served at once.
pub const MAX_CONNECTIONS: usize = 256;
/// How long a connection may sit between requests (or a request's bytes).
const IDLE_TIMEOUT: Duration = Duration::from_secs(300);
/// The largest `/init` body.
const MAX_INIT_BYTES: u64 = 1 << 20;

/// What `/init` set.
#[derive(Debug, Default, Clone)]
pub struct Settings {
    /// The SHA-256 of the access token every request must carry, once set.
    token: Option<[u8; 32]>,
    /// Environment added to every command.
    pub env: BTreeMap<String, String>,
    /// The user of requests that name none.
    pub default_user: Option<String>,
    /// The working directory of commands that name none.
    pub default_workdir: Option<String>,
}

/// The state envd's handlers share.
pub struct Shared {
    /// The sandbox (pause) container's id.
    pub sandbox_id: String,
    /// The agent's containers.
    pub registry: Arc<Registry>,
    /// The agent's reaper.
    pub reaper: Arc<Reaper>,
    settings: Mutex<Settings>,
    /// The processes envd started.
    pub procs: process::Table,
    /// The directory watchers.
    pub watchers: watch::Watchers,
    connections: AtomicUsize,
    stopped: AtomicBool,
}

impl Shared {
    /// A copy of the settings.
    pub fn settings(&self) -> Settings {
        lock(&self.settings).clone()
    }
}

/// Who calls, and how they want their stream.
#[derive(Debug, Default)]
pub struct Caller {
    /// The user from `Authorization`.
    pub user: Option<String>,
    /// `Keepalive-Ping-Interval`.
    pub keepalive: Option<Duration>,
}

/// The envelopes of a server-streaming response; the head goes out with
/// the first.
pub struct StreamOut<'a> {
    w: &'a mut TcpStream,
    keep_alive: bool,
    started: bool,
}

impl StreamOut<'_> {
    fn start(&mut self) -> io::Result<()> {
        if !self.started {
            self.started = true;
            http::write_head(
                self.w,
                200,
                &[("Content-Type", "application/connect+json")],
                None,
                self.keep_alive,
            )?;
        }
        Ok(())
    }

    /// Sends one message; `canceled` when the client is gone.
    pub fn send(&mut self, msg: &Value) -> Result<(), RpcError> {
        let env = connect::envelope(0, msg.to_string().as_bytes());
        self.start()
            .and_then(|()| http::write_chunk(self.w, &env))
            .map_err(|e| RpcError::new(Code::Canceled, format!("the client is gone: {e}")))
    }

    fn finish(&mut self, error: Option<&RpcError>) -> io::Result<()> {
        self.start()?;
        http::write_chunk(self.w, &connect::end_stream(error))?;
        http::finish_chunks(self.w)
    }
}

/// A sandbox's envd listener; dropping it stops the listener (connections
/// being served end with their requests).
pub struct Envd {
    shared: Arc<Shared>,
    listener: Arc<TcpListener>,
}

impl Drop for Envd {
    fn drop(&mut self) {
        self.shared.stopped.store(true, Ordering::SeqCst);
        // Wakes the accepting thread (accept fails with EINVAL).
        let _ = nix::sys::socket::shutdown(
            std::os::fd::AsRawFd::as_raw_fd(self.listener.as_ref()),
            nix::sys::socket::Shutdown::Both,
        );
    }
}

/// What a pod asks of envd (on, and the access token it requires from
/// the start, if any).
pub type Policy = twig_agent::proto::contract::EnvdPolicy;

/// What the pod's sandbox spec asks of envd; `None`: no envd. An invalid
/// annotation is an error naming it.
pub fn wanted(spec: &Spec) -> Result<Option<Policy>, String> {
    let annotations = spec.annotations().as_ref();
    twig_agent::proto::contract::envd_policy(|k| {
        annotations.and_then(|a| a.get(k)).map(String::as_str)
    })
}

impl Envd {
    /// Requires the access token whose SHA-256 is `digest` from now on,
    /// unless a token is set already (`/init`'s, or one restored with the
    /// VM's memory, stays).
    pub fn require_token(&self, digest: [u8; 32]) {
        lock(&self.shared.settings).token.get_or_insert(digest);
    }
}

/// Starts envd for sandbox `sandbox_id`, whose pause is `pause_pid`,
/// listening on [`ENVD_PORT`](twig_agent::proto::contract::ENVD_PORT) in
/// that process's network namespace, as `policy` asks.
pub fn start(
    sandbox_id: &str,
    pause_pid: i32,
    policy: Policy,
    registry: Arc<Registry>,
    reaper: Arc<Reaper>,
) -> io::Result<Envd> {
    let port = twig_agent::proto::contract::ENVD_PORT;
    let netns = File::open(format!("/proc/{pause_pid}/ns/net"))?;
    // Bound from a thread inside the pod's network namespace; the socket
    // stays in it whichever thread accepts.
    let listener = std::thread::scope(|s| {
        s.spawn(|| {
            setns(netns.as_fd(), CloneFlags::CLONE_NEWNET).map_err(io::Error::from)?;
            TcpListener::bind(SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)))
        })
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("the binding thread panicked")))
    })?;
    let listener = Arc::new(listener);
    let shared = Arc::new(Shared {
        sandbox_id: sandbox_id.to_string(),
        registry,
        reaper,
        settings: Mutex::new(Settings {
            token: policy.token_sha256,
            ..Settings::default()
        }),
        procs: process::Table::default(),
        watchers: watch::Watchers::default(),
        connections: AtomicUsize::new(0),
        stopped: AtomicBool::new(false),
    });
    let (l, s) = (listener.clone(), shared.clone());
    std::thread::Builder::new()
        .name("envd-accept".into())
        .spawn(move || accept_loop(&l, &s))?;
    tracing::info!(sandbox = sandbox_id, port, "envd listening");
    Ok(Envd { shared, listener })
}

fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>) {
    loop {
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(_) if shared.stopped.load(Ordering::SeqCst) => return,
            Err(e) => {
                // Out of descriptors or memory: wait a little for some.
                tracing::warn!("envd accept: {e}");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        if shared.connections.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
            shared.connections.fetch_sub(1, Ordering::SeqCst);
            tracing::warn!("envd: {MAX_CONNECTIONS} connections open; refusing one");
            continue;
        }
        let s = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("envd-conn".into())
            .spawn(move || {
                if let Err(e) = serve(&s, stream) {
                    tracing::debug!("envd connection: {e}");
                }
                s.connections.fetch_sub(1, Ordering::SeqCst);
            });
        if let Err(e) = spawned {
            shared.connections.fetch_sub(1, Ordering::SeqCst);
            tracing::warn!("envd: starting a connection thread: {e}");
        }
    }
}

fn serve(shared: &Arc<Shared>, stream: TcpStream) -> io::Result<()> {
    stream.set_read_timeout(Some(IDLE_TIMEOUT))?;
    stream.set_nodelay(true)?;
    let mut conn = Conn::new(stream);
    let mut w = conn.writer()?;
    loop {
        let req = match conn.read_request() {
            Ok(Some(r)) => r,
            Ok(None) => return Ok(()),
            Err(e) => {
                if let Some(status) = e.status() {
                    let body = plain_error(status, &e.to_string());
                    http::respond(&mut w, status, "application/json", &body, false)?;
                }
                return Ok(());
            }
        };
        if shared.stopped.load(Ordering::SeqCst) {
            return Ok(());
        }
        let reusable = route(shared, &mut conn, &mut w, &req)?;
        if !reusable || !req.keep_alive {
            return Ok(());
        }
    }
}

fn plain_error(status: u16, message: &str) -> Vec<u8> {
    serde_json::json!({"message": message, "code": status})
        .to_string()
        .into_bytes()
}

/// Constant-time equality (the length is not secret).
fn sha256(bytes: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).into()
}

fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// After an answer sent before the request's body was read, on a
/// connection that then closes: ends our side and reads what the client
/// still sends for a moment (bounded), so that closing does not reset the
/// connection — a reset can discard the answer before the client reads it.
fn linger(w: &mut TcpStream) {
    const MAX: usize = 1 << 20;
    let _ = w.shutdown(std::net::Shutdown::Write);
    let _ = w.set_read_timeout(Some(std::time::Duration::from_millis(200)));
    let mut buf = [0u8; 16 * 1024];
    let mut read = 0;
    while read < MAX {
        match io::Read::read(w, &mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => read += n,
        }
    }
}

/// Answers one request; whether the connection can take another.
fn route(
    shared: &Arc<Shared>,
    conn: &mut Conn<TcpStream>,
    w: &mut TcpStream,
    req: &Request,
) -> io::Result<bool> {
    let rpc = req.path.starts_with("/process.Process/")
        || req.path.starts_with("/filesystem.Filesystem/");
    let keep = req.keep_alive;
    // Answering before the body is read: the connection cannot go on
    // unless there is no body.
    let early = |w: &mut TcpStream, status: u16, body: &[u8]| {
        let reusable = keep && req.body == http::BodyKind::Length(0);
        http::respond(w, status, "application/json", body, reusable)?;
        if !reusable {
            linger(w);
        }
        Ok(reusable)
    };
    if req.path == "/health" {
        return early(w, 204, b"");
    }
    if let Some(token) = lock(&shared.settings).token {
        let given = req.header("x-access-token").unwrap_or("");
        if !same(&sha256(given.as_bytes()), &token) {
            let message = "the X-Access-Token header is missing or wrong";
            let body = match rpc {
                true => RpcError::new(Code::Unauthenticated, message)
                    .to_json()
                    .to_string()
                    .into_bytes(),
                false => plain_error(401, message),
            };
            return early(w, 401, &body);
        }
    }
    match (req.method.as_str(), req.path.as_str()) {
        ("POST", "/init") => {
            let body = match conn.body(req, MAX_INIT_BYTES).and_then(|b| b.read_all()) {
                Ok(b) => b,
                Err(e) => return http_error(w, &e),
            };
            match init(shared, &body) {
                Ok(()) => http::respond(w, 204, "", b"", keep).map(|()| keep),
                Err(m) => http::respond(w, 400, "application/json", &plain_error(400, &m), keep)
                    .map(|()| keep),
            }
        }
        ("GET", "/files") => match files::get(shared, req, w) {
            Ok(()) => Ok(keep),
            // 0: the head went out already; the connection is cut.
            Err(e) if e.status == 0 => Ok(false),
            Err(e) => early(w, e.status, &e.body()),
        },
        ("POST", "/files") => {
            let body = match conn.body(req, files::MAX_UPLOAD_BYTES) {
                Ok(b) => b,
                Err(e) => return http_error(w, &e),
            };
            match files::post(shared, req, body) {
                Ok(json) => http::respond(w, 200, "application/json", &json, keep).map(|()| keep),
                // The body may be left unread: close after answering.
                Err(e) => {
                    http::respond(w, e.status, "application/json", &e.body(), false).map(|()| false)
                }
            }
        }
        ("POST", _) if rpc => rpc_call(shared, conn, w, req),
        (_, "/init" | "/files") => early(w, 405, &plain_error(405, "method not allowed")),
        _ => early(w, 404, &plain_error(404, &format!("no route {}", req.path))),
    }
}

fn http_error(w: &mut TcpStream, e: &HttpError) -> io::Result<bool> {
    if let Some(status) = e.status() {
        http::respond(
            w,
            status,
            "application/json",
            &plain_error(status, &e.to_string()),
            false,
        )?;
    }
    Ok(false)
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct InitRequest {
    #[serde(default)]
    env_vars: BTreeMap<String, String>,
    access_token: Option<String>,
    default_user: Option<String>,
    default_workdir: Option<String>,
}

fn init(shared: &Shared, body: &[u8]) -> Result<(), String> {
    let body = if body.is_empty() { &b"{}"[..] } else { body };
    let req: InitRequest = serde_json::from_slice(body).map_err(|e| format!("/init: {e}"))?;
    let mut s = lock(&shared.settings);
    if let Some(t) = req.access_token.filter(|t| !t.is_empty()) {
        s.token = Some(sha256(t.as_bytes()));
    }
    s.env.extend(req.env_vars);
    if let Some(u) = req.default_user.filter(|u| !u.is_empty()) {
        s.default_user = Some(u);
    }
    if let Some(d) = req.default_workdir.filter(|d| !d.is_empty()) {
        s.default_workdir = Some(d);
    }
    tracing::info!(sandbox = shared.sandbox_id, "envd initialized");
    Ok(())
}

/// A Connect call: unary (JSON) or server-streaming (envelopes).
fn rpc_call(
    shared: &Arc<Shared>,
    conn: &mut Conn<TcpStream>,
    w: &mut TcpStream,
    req: &Request,
) -> io::Result<bool> {
    let keep = req.keep_alive;
    let (service, method) = req.path[1..].split_once('/').unwrap_or(("", ""));
    let client_streaming = (service, method) == ("process.Process", "StreamInput");
    let streaming = client_streaming
        || matches!(
            (service, method),
            ("process.Process", "Start" | "Connect") | ("filesystem.Filesystem", "WatchDir")
        );
    let media = req.media_type();
    let expected = if streaming {
        "application/connect+json"
    } else {
        "application/json"
    };
    if media != expected {
        let e = RpcError::new(
            Code::Unimplemented,
            format!("content type {media:?}: only {expected} is supported"),
        );
        let reusable = keep && req.body == http::BodyKind::Length(0);
        http::respond(
            w,
            415,
            "application/json",
            e.to_json().to_string().as_bytes(),
            reusable,
        )?;
        return Ok(reusable);
    }
    if client_streaming {
        // Each message is read and acted on as it arrives; the body is as
        // long as the client streams (each message bounded).
        let mut out = StreamOut {
            w,
            keep_alive: keep,
            started: false,
        };
        let r = match conn.body(req, u64::MAX) {
            Ok(mut body) => process::stream_input(shared, || connect::read_message(&mut body)),
            Err(e) => Err(RpcError::invalid(e.to_string())),
        };
        // After an error the rest of the body is unread: the connection
        // ends with the answer.
        return match r {
            Ok(()) => match out.send(&serde_json::json!({})) {
                Ok(()) => out.finish(None).map(|()| keep),
                Err(_) => Ok(false),
            },
            Err(e) => out.finish(Some(&e)).map(|()| false),
        };
    }
    let max = connect::MAX_MESSAGE_BYTES as u64 + 5;
    let body = match conn.body(req, max).and_then(|b| b.read_all()) {
        Ok(b) => b,
        Err(e) => return http_error(w, &e),
    };
    let caller = match sandbox::user_from_auth(req.header("authorization")) {
        Ok(user) => Caller {
            user,
            keepalive: req
                .header("keepalive-ping-interval")
                .and_then(|v| v.parse::<u64>().ok())
                .map(|s| Duration::from_secs(s.clamp(1, 3600))),
        },
        Err(e) if streaming => {
            let mut out = StreamOut {
                w,
                keep_alive: keep,
                started: false,
            };
            return out.finish(Some(&e)).map(|()| keep);
        }
        Err(e) => return unary_reply(w, Err(e), keep),
    };
    if streaming {
        let mut out = StreamOut {
            w,
            keep_alive: keep,
            started: false,
        };
        let r = connect::single_message(&body).and_then(|msg| match service {
            "process.Process" => process::stream(shared, &caller, method, msg, &mut out),
            _ => watch::stream(shared, &caller, msg, &mut out),
        });
        return match r {
            Err(e) if e.code == Code::Canceled => Ok(false),
            Err(e) => out.finish(Some(&e)).map(|()| keep),
            Ok(()) => out.finish(None).map(|()| keep),
        };
    }
    let r = match service {
        "process.Process" => process::unary(shared, method, &body),
        _ => filesystem::unary(shared, &caller, method, &body),
    };
    unary_reply(w, r, keep)
}

fn unary_reply(w: &mut TcpStream, r: Result<Value, RpcError>, keep: bool) -> io::Result<bool> {
    let (status, body) = match r {
        Ok(v) => (200, v.to_string()),
        Err(e) => {
            if e.code == Code::Internal {
                tracing::warn!("envd: {e}");
            }
            (e.code.http_status(), e.to_json().to_string())
        }
    };
    http::respond(w, status, "application/json", body.as_bytes(), keep).map(|()| keep)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    /// Reads the rest of a stream.
    fn read_all(mut r: impl Read) -> Vec<u8> {
        let mut v = Vec::new();
        let _ = r.read_to_end(&mut v);
        v
    }

    #[test]
    fn tokens_compare_whole() {
        assert!(same(b"abc", b"abc"));
        assert!(!same(b"abc", b"abd"));
        assert!(!same(b"abc", b"ab"));
        assert!(!same(b"", b"a"));
    }

    fn shared() -> Arc<Shared> {
        shared_with(None)
    }

    fn shared_with(token: Option<[u8; 32]>) -> Arc<Shared> {
        Arc::new(Shared {
            sandbox_id: "sb".into(),
            registry: Arc::default(),
            reaper: Reaper::start(),
            settings: Mutex::new(Settings {
                token,
                ..Settings::default()
            }),
            procs: process::Table::default(),
            watchers: watch::Watchers::default(),
            connections: AtomicUsize::new(0),
            stopped: AtomicBool::new(false),
        })
    }

    /// One request over a real socket pair; the raw response.
    fn exchange(s: &Arc<Shared>, request: &str) -> String {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (server, _) = l.accept().unwrap();
        client.write_all(request.as_bytes()).unwrap();
        client.shutdown(std::net::Shutdown::Write).unwrap();
        serve(s, server).unwrap();
        String::from_utf8(read_all(client)).unwrap()
    }

    #[test]
    fn a_token_the_pod_set_is_required_from_the_first_request() {
        let s = shared_with(Some(sha256(b"from-the-pod")));
        let list = "POST /process.Process/List HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: 2\r\n";
        let r = exchange(&s, &format!("{list}\r\n{{}}"));
        assert!(r.starts_with("HTTP/1.1 401 "), "{r}");
        let init = r#"{"accessToken":"next"}"#;
        let post_init = |token: &str| {
            format!(
                "POST /init HTTP/1.1\r\nX-Access-Token: {token}\r\nContent-Length: {}\r\n\r\n{init}",
                init.len()
            )
        };
        let r = exchange(&s, &post_init("guess"));
        assert!(r.starts_with("HTTP/1.1 401 "), "/init is no way in: {r}");
        let r = exchange(&s, &post_init("from-the-pod"));
        assert!(r.starts_with("HTTP/1.1 204 "), "{r}");
        // /init changed it: the old token is refused, the new one served.
        let r = exchange(
            &s,
            &format!("{list}X-Access-Token: from-the-pod\r\n\r\n{{}}"),
        );
        assert!(r.starts_with("HTTP/1.1 401 "), "{r}");
        let r = exchange(&s, &format!("{list}X-Access-Token: next\r\n\r\n{{}}"));
        assert!(r.starts_with("HTTP/1.1 200 "), "{r}");
    }

    /// A StreamInput request carrying `messages` (each one envelope).
    fn stream_input(messages: &[&[u8]]) -> String {
        let body: Vec<u8> = messages
            .iter()
            .flat_map(|m| connect::envelope(0, m))
            .collect();
        let mut req = format!(
            "POST /process.Process/StreamInput HTTP/1.1\r\nContent-Type: application/connect+json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        )
        .into_bytes();
        req.extend_from_slice(&body);
        String::from_utf8_lossy(&req).into_owned()
    }

    #[test]
    fn stream_input_names_its_process_first_and_checks_every_message() {
        let s = shared();
        let start = br#"{"start":{"process":{"pid":4242}}}"#;
        let data = br#"{"data":{"input":{"stdin":"YWJjCg=="}}}"#;
        for (messages, want) in [
            (&[&start[..], &data[..]][..], "not_found"),
            (&[&data[..]][..], "input before the start message"),
            (&[&br#"{"data":{}}"#[..]][..], "invalid_argument"),
            (&[&b"not json"[..]][..], "invalid_argument"),
        ] {
            let r = exchange(&s, &stream_input(messages));
            assert!(r.starts_with("HTTP/1.1 200 "), "{r}");
            assert!(r.contains(want), "{want}: {r}");
        }
        // Only keepalives: the stream ends cleanly with an empty answer.
        let r = exchange(&s, &stream_input(&[br#"{"keepalive":{}}"#]));
        assert!(
            r.starts_with("HTTP/1.1 200 ") && !r.contains("error"),
            "{r}"
        );
        // A body ending inside an envelope.
        let cut = "POST /process.Process/StreamInput HTTP/1.1\r\nContent-Type: application/connect+json\r\nContent-Length: 3\r\n\r\n\0\0\0";
        let r = exchange(&s, cut);
        assert!(r.contains("inside an envelope"), "{r}");
    }

    #[test]
    fn health_init_token_and_errors_over_a_socket() {
        let s = shared();
        let r = exchange(&s, "GET /health HTTP/1.1\r\n\r\n");
        assert!(r.starts_with("HTTP/1.1 204 "), "{r}");
        let body = r#"{"accessToken":"t0k","envVars":{"A":"1"},"defaultUser":"root"}"#;
        let r = exchange(
            &s,
            &format!(
                "POST /init HTTP/1.1\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            ),
        );
        assert!(r.starts_with("HTTP/1.1 204 "), "{r}");
        assert_eq!(s.settings().env.get("A").map(String::as_str), Some("1"));
        // Now every request but /health needs the token.
        let r = exchange(&s, "GET /health HTTP/1.1\r\n\r\n");
        assert!(r.starts_with("HTTP/1.1 204 "), "{r}");
        let list = "POST /process.Process/List HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: 2\r\n";
        let r = exchange(&s, &format!("{list}X-Access-Token: nope\r\n\r\n{{}}"));
        assert!(
            r.starts_with("HTTP/1.1 401 ") && r.contains("unauthenticated"),
            "{r}"
        );
        let r = exchange(&s, &format!("{list}\r\n{{}}"));
        assert!(r.starts_with("HTTP/1.1 401 "), "{r}");
        let r = exchange(&s, "POST /init HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}");
        assert!(
            r.starts_with("HTTP/1.1 401 "),
            "/init needs the token too: {r}"
        );
        let r = exchange(&s, &format!("{list}X-Access-Token: t0k\r\n\r\n{{}}"));
        assert!(
            r.starts_with("HTTP/1.1 200 ") && r.ends_with(r#"{"processes":[]}"#),
            "{r}"
        );
        // No container: a stream ends with failed_precondition.
        let start = connect::envelope(0, br#"{"process":{"cmd":"true"}}"#);
        let mut req = format!(
            "POST /process.Process/Start HTTP/1.1\r\nX-Access-Token: t0k\r\nContent-Type: application/connect+json\r\nContent-Length: {}\r\n\r\n",
            start.len()
        )
        .into_bytes();
        req.extend_from_slice(&start);
        let r = exchange(&s, &String::from_utf8_lossy(&req));
        assert!(
            r.starts_with("HTTP/1.1 200 ") && r.contains("failed_precondition"),
            "{r}"
        );
        // Unknown routes, wrong content type, hostile heads.
        let r = exchange(&s, "GET /nope HTTP/1.1\r\nX-Access-Token: t0k\r\n\r\n");
        assert!(r.starts_with("HTTP/1.1 404 "), "{r}");
        let r = exchange(&s, "POST /filesystem.Filesystem/Stat HTTP/1.1\r\nX-Access-Token: t0k\r\nContent-Type: application/proto\r\n\r\n");
        assert!(r.starts_with("HTTP/1.1 415 "), "{r}");
        let r = exchange(&s, "GARBAGE\r\n\r\n");
        assert!(r.starts_with("HTTP/1.1 400 "), "{r}");
        let r = exchange(
            &s,
            &format!(
                "POST /init HTTP/1.1\r\nX-Access-Token: t0k\r\nContent-Length: {}\r\n\r\n",
                MAX_INIT_BYTES + 1
            ),
        );
        assert!(r.starts_with("HTTP/1.1 413 "), "{r}");
    }
}
