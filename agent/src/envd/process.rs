//! `process.Process`: commands run in the pod's main container through the
//! agent's own exec path (`Container::exec`, as ExecProcess: the
//! container's namespaces, cgroup, rlimits, seccomp, capabilities and
//! no_new_privs), its spec's `process` the base, with the caller's
//! command, user, working directory and environment.
//!
//! Each process has one thread draining its output (and one more for
//! stderr) into the streams attached to it: `Start`'s and any `Connect`'s.
//! With none attached the output is read and dropped, so a command
//! nobody watches never blocks. Attached streams are bounded channels: a
//! slow client slows the process down, nothing is dropped. Once both
//! outputs end and the process has exited, every stream gets `end` and the
//! process is forgotten (its exec id freed).

use std::collections::HashMap;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::connect::{decode, Code, RpcError};
use super::sandbox::{in_container, lookup_user, main_container, Target, User};
use super::{Caller, Shared, StreamOut};
use crate::container::Process;
use crate::reaper::{lock, Exit};
use crate::spec::parse_process;
use crate::stdio::{set_winsize, write_with_deadline, DEFAULT_READ_BYTES};

/// How many output chunks wait for a slow stream before the process waits.
const STREAM_DEPTH: usize = 16;
/// How long SendInput waits for the process to take its input.
const STDIN_TIMEOUT: Duration = Duration::from_secs(10);
/// The most processes envd keeps at once.
const MAX_PROCESSES: usize = 1024;

/// What a process's streams carry.
#[derive(Debug, Clone)]
enum Event {
    /// Output: `stdout`, `stderr` or `pty`, and its bytes.
    Data(&'static str, Vec<u8>),
    /// The end event's JSON.
    End(Value),
}

#[derive(Default)]
struct Hub {
    streams: Vec<(u64, SyncSender<Event>)>,
    next: u64,
    ended: bool,
}

/// A process envd started.
pub struct Proc {
    pid: u32,
    tag: Option<String>,
    config: Value,
    exec_id: String,
    container_id: String,
    process: Arc<Process>,
    hub: Mutex<Hub>,
}

impl Proc {
    /// A new stream of its events; `None` once it has ended.
    fn attach(&self) -> Option<Receiver<Event>> {
        let (tx, rx) = sync_channel(STREAM_DEPTH);
        let mut hub = lock(&self.hub);
        if hub.ended {
            return None;
        }
        hub.next += 1;
        let id = hub.next;
        hub.streams.push((id, tx));
        Some(rx)
    }

    fn broadcast(&self, event: Event) {
        let streams = lock(&self.hub).streams.clone();
        let gone: Vec<u64> = streams
            .into_iter()
            .filter(|(_, tx)| tx.send(event.clone()).is_err())
            .map(|(id, _)| id)
            .collect();
        if !gone.is_empty() {
            lock(&self.hub).streams.retain(|(id, _)| !gone.contains(id));
        }
    }

    fn finish(&self, end: Value) {
        let streams = {
            let mut hub = lock(&self.hub);
            hub.ended = true;
            std::mem::take(&mut hub.streams)
        };
        for (_, tx) in streams {
            let _ = tx.send(Event::End(end.clone()));
        }
    }
}

/// The processes envd started, by pid.
#[derive(Default)]
pub struct Table {
    procs: Mutex<HashMap<u32, Arc<Proc>>>,
    next_exec: AtomicU64,
}

impl Table {
    fn find(&self, selector: &Selector) -> Result<Arc<Proc>, RpcError> {
        let procs = lock(&self.procs);
        let found = match (&selector.pid, &selector.tag) {
            (Some(pid), _) => {
                let pid = json_uint(pid)
                    .ok_or_else(|| RpcError::invalid(format!("pid {pid} is not a number")))?;
                procs.get(&pid).cloned()
            }
            (None, Some(tag)) => procs
                .values()
                .find(|p| p.tag.as_deref() == Some(tag.as_str()))
                .cloned(),
            (None, None) => {
                return Err(RpcError::invalid(
                    "the process selector names no pid or tag",
                ))
            }
        };
        found.ok_or_else(|| match (&selector.pid, &selector.tag) {
            (Some(pid), _) => RpcError::not_found(format!("no process with pid {pid}")),
            _ => RpcError::not_found(format!("no process tagged {:?}", selector.tag)),
        })
    }
}

fn json_uint(v: &Value) -> Option<u32> {
    match v {
        Value::Number(n) => n.as_u64().and_then(|n| u32::try_from(n).ok()),
        Value::String(s) => s.parse().ok(),
        _ => None,
    }
}

#[derive(Debug, Deserialize)]
struct Selector {
    pid: Option<Value>,
    tag: Option<String>,
}

#[derive(Debug, Deserialize)]
struct ProcessConfig {
    cmd: String,
    #[serde(default)]
    args: Vec<String>,
    #[serde(default)]
    envs: HashMap<String, String>,
    cwd: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
struct PtySize {
    #[serde(default)]
    cols: u32,
    #[serde(default)]
    rows: u32,
}

#[derive(Debug, Default, Deserialize)]
struct Pty {
    #[serde(default)]
    size: PtySize,
}

#[derive(Debug, Deserialize)]
struct StartRequest {
    process: ProcessConfig,
    pty: Option<Pty>,
    tag: Option<String>,
    stdin: Option<bool>,
}

#[derive(Debug, Deserialize)]
struct SelectorRequest {
    process: Selector,
}

#[derive(Debug, Deserialize)]
struct InputRequest {
    process: Selector,
    input: Map<String, Value>,
}

#[derive(Debug, Deserialize)]
struct SignalRequest {
    process: Selector,
    signal: Value,
}

#[derive(Debug, Deserialize)]
struct UpdateRequest {
    process: Selector,
    pty: Option<Pty>,
}

/// A unary method.
pub fn unary(shared: &Arc<Shared>, method: &str, body: &[u8]) -> Result<Value, RpcError> {
    match method {
        "List" => {
            let procs = lock(&shared.procs.procs);
            let list: Vec<Value> = procs
                .values()
                .map(|p| {
                    let mut info = json!({"config": p.config, "pid": p.pid});
                    if let Some(tag) = &p.tag {
                        info["tag"] = json!(tag);
                    }
                    info
                })
                .collect();
            Ok(json!({ "processes": list }))
        }
        "SendInput" => {
            let req: InputRequest = decode(body)?;
            write_input(shared.procs.find(&req.process)?.as_ref(), &req.input)?;
            Ok(json!({}))
        }
        "SendSignal" => {
            let req: SignalRequest = decode(body)?;
            let sig = signal_of(&req.signal)?;
            let p = shared.procs.find(&req.process)?;
            if p.process.exited().is_some() {
                return Err(RpcError::not_found(format!("process {} has exited", p.pid)));
            }
            kill(Pid::from_raw(p.process.pid), sig)
                .map_err(|e| RpcError::internal(format!("sending {sig} to {}: {e}", p.pid)))?;
            Ok(json!({}))
        }
        "CloseStdin" => {
            let req: SelectorRequest = decode(body)?;
            let p = shared.procs.find(&req.process)?;
            if p.process.tty.is_some() {
                return Err(RpcError::new(
                    Code::FailedPrecondition,
                    "a PTY has no stdin to close: send Ctrl+D (0x04)",
                ));
            }
            lock(&p.process.stdin).take();
            Ok(json!({}))
        }
        "Update" => {
            let req: UpdateRequest = decode(body)?;
            let p = shared.procs.find(&req.process)?;
            if let Some(pty) = req.pty {
                let tty = p.process.tty.as_ref().ok_or_else(|| {
                    RpcError::new(Code::FailedPrecondition, "the process has no PTY")
                })?;
                let (rows, cols) = pty_size(&pty.size)?;
                set_winsize(tty.as_fd(), rows, cols)?;
            }
            Ok(json!({}))
        }
        other => Err(RpcError::new(
            Code::Unimplemented,
            format!("process.Process/{other}"),
        )),
    }
}

/// Writes `input` (`stdin` or `pty` bytes) to the process's stdin (a PTY's
/// is its terminal), within [`STDIN_TIMEOUT`].
fn write_input(p: &Proc, input: &Map<String, Value>) -> Result<(), RpcError> {
    let data = match (input.get("stdin"), input.get("pty")) {
        (Some(v), _) | (None, Some(v)) => decode_bytes(v)?,
        (None, None) => return Err(RpcError::invalid("the input has no stdin or pty")),
    };
    let stdin = lock(&p.process.stdin);
    let fd = stdin
        .as_ref()
        .ok_or_else(|| RpcError::new(Code::FailedPrecondition, "the process's stdin is closed"))?;
    let n = write_with_deadline(fd.as_fd(), &data, STDIN_TIMEOUT)?;
    if n < data.len() {
        return Err(RpcError::new(
            Code::DeadlineExceeded,
            format!(
                "the process took {n} of {} bytes within {STDIN_TIMEOUT:?}",
                data.len()
            ),
        ));
    }
    Ok(())
}

/// `StreamInput`, client streaming: its first message (`start`) names the
/// process, then each `data` message's input is written as it arrives
/// (`keepalive`s are skipped), until the request body ends. `next` gives
/// the messages.
pub fn stream_input(
    shared: &Shared,
    mut next: impl FnMut() -> Result<Option<Vec<u8>>, RpcError>,
) -> Result<(), RpcError> {
    let mut process = None;
    while let Some(message) = next()? {
        let event: Map<String, Value> = decode(&message)?;
        if let Some(start) = event.get("start") {
            let start: SelectorRequest = serde_json::from_value(start.clone())
                .map_err(|e| RpcError::invalid(format!("the start message: {e}")))?;
            process = Some(shared.procs.find(&start.process)?);
        } else if let Some(data) = event.get("data") {
            let p = process
                .as_ref()
                .ok_or_else(|| RpcError::invalid("input before the start message"))?;
            let input = data
                .get("input")
                .and_then(Value::as_object)
                .ok_or_else(|| RpcError::invalid("a data message without input"))?;
            write_input(p, input)?;
        }
    }
    Ok(())
}

/// A server-streaming method (`Start`, `Connect`).
pub fn stream(
    shared: &Arc<Shared>,
    caller: &Caller,
    method: &str,
    msg: &[u8],
    out: &mut StreamOut<'_>,
) -> Result<(), RpcError> {
    let (pid, rx) = match method {
        "Start" => start(shared, caller, decode(msg)?)?,
        "Connect" => {
            let req: SelectorRequest = decode(msg)?;
            let p = shared.procs.find(&req.process)?;
            let rx = p
                .attach()
                .ok_or_else(|| RpcError::not_found(format!("process {} has ended", p.pid)))?;
            (p.pid, rx)
        }
        other => {
            return Err(RpcError::new(
                Code::Unimplemented,
                format!("process.Process/{other} is not a stream"),
            ))
        }
    };
    out.send(&json!({"event": {"start": {"pid": pid}}}))?;
    loop {
        let event = match caller.keepalive {
            Some(every) => match rx.recv_timeout(every) {
                Ok(e) => e,
                Err(RecvTimeoutError::Timeout) => {
                    out.send(&json!({"event": {"keepalive": {}}}))?;
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => return Ok(()),
            },
            None => match rx.recv() {
                Ok(e) => e,
                Err(_) => return Ok(()),
            },
        };
        match event {
            Event::Data(kind, bytes) => {
                let b64 = base64::engine::general_purpose::STANDARD.encode(&bytes);
                out.send(&json!({"event": {"data": {kind: b64}}}))?;
            }
            Event::End(end) => return out.send(&json!({"event": {"end": end}})),
        }
    }
}

fn start(
    shared: &Arc<Shared>,
    caller: &Caller,
    req: StartRequest,
) -> Result<(u32, Receiver<Event>), RpcError> {
    if req.process.cmd.is_empty() {
        return Err(RpcError::invalid("the process has no cmd"));
    }
    if lock(&shared.procs.procs).len() >= MAX_PROCESSES {
        return Err(RpcError::new(
            Code::ResourceExhausted,
            format!("{MAX_PROCESSES} processes are running"),
        ));
    }
    let target = main_container(&shared.registry)?;
    let settings = shared.settings();
    let name = caller.user.clone().or(settings.default_user.clone());
    let wanted_cwd = req
        .process
        .cwd
        .clone()
        .filter(|c| !c.is_empty())
        .or(settings.default_workdir.clone());
    let (user, cwd) = in_container(&target, None, || {
        let user = lookup_user(name.as_deref(), &target.process)?;
        let cwd = match &wanted_cwd {
            Some(c) => super::filesystem::resolve(c, &user.home)?
                .to_string_lossy()
                .into_owned(),
            None if std::path::Path::new(&user.home).is_dir() => user.home.clone(),
            None => target
                .process
                .get("cwd")
                .and_then(Value::as_str)
                .unwrap_or("/")
                .to_string(),
        };
        Ok((user, cwd))
    })?;
    let mut env: Vec<(String, String)> = Vec::new();
    let base_env = target.process.get("env").and_then(Value::as_array);
    for kv in base_env.into_iter().flatten().filter_map(Value::as_str) {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        set_env(&mut env, k, v);
    }
    set_env(&mut env, "HOME", &user.home);
    set_env(&mut env, "USER", &user.name);
    for (k, v) in settings.env.iter().chain(req.process.envs.iter()) {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            return Err(RpcError::invalid(format!("environment variable {k:?}")));
        }
        set_env(&mut env, k, v);
    }
    let oci = oci_process(&target, &user, &req, cwd, &env)?;
    let exec_id = format!(
        "envd-{}",
        shared.procs.next_exec.fetch_add(1, Ordering::Relaxed)
    );
    let process = {
        let c = shared.registry.get(&target.container_id)?;
        let mut c = lock(&c);
        c.exec(&shared.reaper, &exec_id, oci)?;
        c.process(&exec_id)?
    };
    let pid = u32::try_from(process.pid).unwrap_or_default();
    if req.stdin == Some(false) && process.tty.is_none() {
        lock(&process.stdin).take();
    }
    let mut config =
        json!({"cmd": req.process.cmd, "args": req.process.args, "envs": req.process.envs});
    if let Some(cwd) = &req.process.cwd {
        config["cwd"] = json!(cwd);
    }
    let proc_ = Arc::new(Proc {
        pid,
        tag: req.tag,
        config,
        exec_id,
        container_id: target.container_id,
        process,
        hub: Mutex::default(),
    });
    let rx = proc_
        .attach()
        .ok_or_else(|| RpcError::internal("a new process has ended"))?;
    lock(&shared.procs.procs).insert(pid, proc_.clone());
    let shared = shared.clone();
    let started = std::thread::Builder::new()
        .name(format!("envd-{pid}"))
        .spawn(move || run_output(&shared, &proc_));
    if let Err(e) = started {
        return Err(RpcError::internal(format!(
            "starting the output thread: {e}"
        )));
    }
    Ok((pid, rx))
}

fn set_env(env: &mut Vec<(String, String)>, k: &str, v: &str) {
    match env.iter_mut().find(|(name, _)| name == k) {
        Some(e) => e.1 = v.to_string(),
        None => env.push((k.to_string(), v.to_string())),
    }
}

/// The program to run for `cmd` in the container whose init is `pid`.
/// E2B's SDKs run every command as `/bin/bash -l -c <cmd>`: in an image
/// without bash (busybox, Alpine) that is its `/bin/sh`, which takes the
/// same flags, rather than a failure on every command.
fn command_of(pid: i32, cmd: &str) -> String {
    let root = format!("/proc/{pid}/root");
    let has = |path: &str| std::fs::symlink_metadata(format!("{root}{path}")).is_ok();
    if cmd == "/bin/bash" && !has("/bin/bash") && has("/bin/sh") {
        return "/bin/sh".to_string();
    }
    cmd.to_string()
}

/// The OCI process to exec: the container's own, with the request's
/// command, user, working directory, environment and terminal.
fn oci_process(
    target: &Target,
    user: &User,
    req: &StartRequest,
    cwd: String,
    env: &[(String, String)],
) -> Result<oci_spec::runtime::Process, RpcError> {
    let mut p = match &target.process {
        Value::Object(o) => o.clone(),
        _ => Map::new(),
    };
    let mut args = vec![command_of(target.init_pid, &req.process.cmd)];
    args.extend(req.process.args.iter().cloned());
    p.insert("args".into(), json!(args));
    p.insert("cwd".into(), json!(cwd));
    let env: Vec<String> = env.iter().map(|(k, v)| format!("{k}={v}")).collect();
    p.insert("env".into(), json!(env));
    let mut u = json!({"uid": user.uid, "gid": user.gid, "additionalGids": user.groups});
    if let Some(umask) = target.process.pointer("/user/umask") {
        u["umask"] = umask.clone();
    }
    p.insert("user".into(), u);
    p.insert("terminal".into(), json!(req.pty.is_some()));
    p.remove("consoleSize");
    if let Some(pty) = &req.pty {
        let (rows, cols) = pty_size(&pty.size)?;
        p.insert("consoleSize".into(), json!({"height": rows, "width": cols}));
    }
    let bytes = serde_json::to_vec(&Value::Object(p))
        .map_err(|e| RpcError::internal(format!("encoding the process: {e}")))?;
    Ok(parse_process(&bytes)?)
}

fn pty_size(size: &PtySize) -> Result<(u16, u16), RpcError> {
    let rows = u16::try_from(size.rows).map_err(|_| RpcError::invalid("PTY rows too large"))?;
    let cols = u16::try_from(size.cols).map_err(|_| RpcError::invalid("PTY cols too large"))?;
    Ok((
        if rows == 0 { 24 } else { rows },
        if cols == 0 { 80 } else { cols },
    ))
}

/// The output thread of `p`: drains its output into its streams, then
/// ends them with its exit and forgets it.
fn run_output(shared: &Shared, p: &Arc<Proc>) {
    let (out_kind, err) = if p.process.tty.is_some() {
        ("pty", None)
    } else {
        let p2 = p.clone();
        let err = std::thread::Builder::new()
            .name(format!("envd-{}-err", p.pid))
            .spawn(move || drain(&p2, false, "stderr"));
        match err {
            Ok(h) => ("stdout", Some(h)),
            Err(e) => {
                tracing::warn!(pid = p.pid, "starting the stderr thread: {e}");
                ("stdout", None)
            }
        }
    };
    drain(p, true, out_kind);
    if let Some(h) = err {
        let _ = h.join();
    }
    let exit = loop {
        if let Some(e) = p.process.exit.wait(Duration::from_secs(3600)) {
            break e;
        }
    };
    p.finish(end_event(exit));
    lock(&shared.procs.procs).remove(&p.pid);
    if let Ok(c) = shared.registry.get(&p.container_id) {
        if let Err(e) = lock(&c).remove_exec(&p.exec_id) {
            tracing::debug!(pid = p.pid, "forgetting exec {}: {e}", p.exec_id);
        }
    }
}

fn drain(p: &Proc, stdout: bool, kind: &'static str) {
    let buf = if stdout {
        &p.process.stdout
    } else {
        &p.process.stderr
    };
    loop {
        let (data, eof) = buf.read_blocking(DEFAULT_READ_BYTES);
        if !data.is_empty() {
            p.broadcast(Event::Data(kind, data));
        }
        if eof {
            return;
        }
    }
}

/// The `end` event of an exit, as Go's `os.ProcessState` words it.
fn end_event(exit: Exit) -> Value {
    if exit.signal == 0 {
        return json!({"exitCode": exit.status, "exited": true, "status": format!("exit status {}", exit.status)});
    }
    let name = match exit.signal {
        1 => "hangup".to_string(),
        2 => "interrupt".to_string(),
        6 => "aborted".to_string(),
        9 => "killed".to_string(),
        11 => "segmentation fault".to_string(),
        13 => "broken pipe".to_string(),
        15 => "terminated".to_string(),
        n => format!("signal {n}"),
    };
    json!({"exitCode": -1, "exited": false, "status": format!("signal: {name}")})
}

/// `SIGNAL_SIGKILL`, `SIGNAL_SIGTERM`, … or a signal's number.
fn signal_of(v: &Value) -> Result<Signal, RpcError> {
    let n = match v {
        Value::String(s) => match s.strip_prefix("SIGNAL_") {
            Some(name) => {
                return name
                    .parse::<Signal>()
                    .map_err(|_| RpcError::invalid(format!("signal {s}")))
            }
            None => s.parse::<i32>().ok(),
        },
        Value::Number(n) => n.as_i64().and_then(|n| i32::try_from(n).ok()),
        _ => None,
    };
    n.filter(|n| *n != 0)
        .and_then(|n| Signal::try_from(n).ok())
        .ok_or_else(|| RpcError::invalid(format!("signal {v}")))
}

fn decode_bytes(v: &Value) -> Result<Vec<u8>, RpcError> {
    use base64::engine::general_purpose::{GeneralPurpose, GeneralPurposeConfig};
    use base64::engine::DecodePaddingMode;
    let s = v
        .as_str()
        .ok_or_else(|| RpcError::invalid("bytes are not a base64 string"))?;
    // Proto3 JSON accepts either alphabet, padded or not.
    let alphabet = if s.contains(['-', '_']) {
        &base64::alphabet::URL_SAFE
    } else {
        &base64::alphabet::STANDARD
    };
    let config =
        GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent);
    GeneralPurpose::new(alphabet, config)
        .decode(s)
        .map_err(|e| RpcError::invalid(format!("bytes: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signals_by_name_and_number() {
        assert_eq!(
            signal_of(&json!("SIGNAL_SIGKILL")).unwrap(),
            Signal::SIGKILL
        );
        assert_eq!(
            signal_of(&json!("SIGNAL_SIGTERM")).unwrap(),
            Signal::SIGTERM
        );
        assert_eq!(signal_of(&json!(15)).unwrap(), Signal::SIGTERM);
        for bad in [
            json!("SIGNAL_UNSPECIFIED"),
            json!(0),
            json!(99999),
            json!(null),
        ] {
            assert!(signal_of(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn end_events_read_as_go_does() {
        let e = end_event(Exit {
            status: 3,
            signal: 0,
        });
        assert_eq!(
            e,
            json!({"exitCode": 3, "exited": true, "status": "exit status 3"})
        );
        let e = end_event(Exit {
            status: 137,
            signal: 9,
        });
        assert_eq!(e["status"], "signal: killed");
        assert_eq!(e["exited"], false);
    }

    #[test]
    fn input_bytes_decode_with_or_without_padding() {
        assert_eq!(decode_bytes(&json!("aGk=")).unwrap(), b"hi");
        assert_eq!(decode_bytes(&json!("aGk")).unwrap(), b"hi");
        assert_eq!(decode_bytes(&json!("_-8")).unwrap(), [0xff, 0xef]);
        assert!(decode_bytes(&json!("***")).is_err());
        assert!(decode_bytes(&json!(1)).is_err());
        assert_eq!(pty_size(&PtySize::default()).unwrap(), (24, 80));
        assert!(pty_size(&PtySize {
            cols: 70_000,
            rows: 1
        })
        .is_err());
    }
}
