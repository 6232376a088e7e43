//! Probes as kubelet's prober runs them (`pkg/kubelet/prober`): exec
//! through CRI's `ExecSync` with the probe's timeout, `httpGet` (2xx and
//! 3xx pass) and `tcpSocket` from the node to the pod's address. A probe's
//! result changes only after `successThreshold` passes or
//! `failureThreshold` failures in a row; readiness starts failed, liveness
//! passed; a startup probe holds the others back until it passes, then
//! stops; a failed liveness or startup probe stops probing until the
//! container is replaced (kubelet's `onHold`). gRPC probes and HTTPS are
//! refused with the field named.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{
    Container, ExecAction, HTTPGetAction, LifecycleHandler, Probe, TCPSocketAction,
};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use twig_cri::CriClient;

/// Which probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// `startupProbe`.
    Startup,
    /// `readinessProbe`.
    Readiness,
    /// `livenessProbe`.
    Liveness,
}

/// How a probe or hook checks the container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Handler {
    /// Runs a command in the container.
    Exec(Vec<String>),
    /// GETs `path` on `port`, at `host` or the pod's address.
    Http {
        /// `host`, when set.
        host: Option<String>,
        /// The resolved port.
        port: u16,
        /// The path.
        path: String,
        /// Extra headers.
        headers: Vec<(String, String)>,
    },
    /// Connects to `port`.
    Tcp {
        /// `host`, when set.
        host: Option<String>,
        /// The resolved port.
        port: u16,
    },
    /// A preStop `sleep`.
    Sleep(Duration),
}

/// A probe of a container, its numbers defaulted as the API server does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeSpec {
    /// Which probe.
    pub kind: Kind,
    /// How.
    pub handler: Handler,
    /// `initialDelaySeconds`.
    pub initial_delay: Duration,
    /// `periodSeconds` (10).
    pub period: Duration,
    /// `timeoutSeconds` (1).
    pub timeout: Duration,
    /// `successThreshold` (1).
    pub success_threshold: u32,
    /// `failureThreshold` (3).
    pub failure_threshold: u32,
}

fn port(p: &IntOrString, container: &Container, field: &str) -> Result<u16, String> {
    match p {
        IntOrString::Int(n) => {
            u16::try_from(*n).map_err(|_| format!("{field}.port: {n} is not a port"))
        }
        IntOrString::String(name) => container
            .ports
            .iter()
            .flatten()
            .find(|cp| cp.name.as_deref() == Some(name))
            .and_then(|cp| u16::try_from(cp.container_port).ok())
            .ok_or_else(|| format!("{field}.port: no container port named {name:?}")),
    }
}

fn exec(e: &ExecAction) -> Handler {
    Handler::Exec(e.command.clone().unwrap_or_default())
}

fn http(h: &HTTPGetAction, c: &Container, field: &str) -> Result<Handler, String> {
    if h.scheme
        .as_deref()
        .is_some_and(|s| s.eq_ignore_ascii_case("https"))
    {
        return Err(format!(
            "{field}.scheme: HTTPS is not supported by the test kubelet"
        ));
    }
    Ok(Handler::Http {
        host: h.host.clone().filter(|h| !h.is_empty()),
        port: port(&h.port, c, field)?,
        path: h
            .path
            .clone()
            .filter(|p| !p.is_empty())
            .unwrap_or_else(|| "/".into()),
        headers: h
            .http_headers
            .iter()
            .flatten()
            .map(|h| (h.name.clone(), h.value.clone()))
            .collect(),
    })
}

fn tcp(t: &TCPSocketAction, c: &Container, field: &str) -> Result<Handler, String> {
    Ok(Handler::Tcp {
        host: t.host.clone().filter(|h| !h.is_empty()),
        port: port(&t.port, c, field)?,
    })
}

fn secs(v: Option<i32>, default: u64) -> Duration {
    Duration::from_secs(v.and_then(|v| u64::try_from(v).ok()).unwrap_or(default))
}

/// The container's probe of `kind`, if it has one; `Err` names a field the
/// test kubelet cannot honour.
pub fn probe_spec(container: &Container, kind: Kind) -> Result<Option<ProbeSpec>, String> {
    let (probe, field): (Option<&Probe>, &str) = match kind {
        Kind::Startup => (container.startup_probe.as_ref(), "startupProbe"),
        Kind::Readiness => (container.readiness_probe.as_ref(), "readinessProbe"),
        Kind::Liveness => (container.liveness_probe.as_ref(), "livenessProbe"),
    };
    let Some(p) = probe else {
        return Ok(None);
    };
    let field = format!("container {}: {field}", container.name);
    let handler = if let Some(e) = &p.exec {
        exec(e)
    } else if let Some(h) = &p.http_get {
        http(h, container, &format!("{field}.httpGet"))?
    } else if let Some(t) = &p.tcp_socket {
        tcp(t, container, &format!("{field}.tcpSocket"))?
    } else if p.grpc.is_some() {
        return Err(format!(
            "{field}.grpc: gRPC probes are not supported by the test kubelet"
        ));
    } else {
        return Err(format!("{field}: no handler"));
    };
    // Liveness and startup probes must have successThreshold 1 (validation).
    Ok(Some(ProbeSpec {
        kind,
        handler,
        initial_delay: secs(p.initial_delay_seconds, 0),
        period: secs(p.period_seconds, 10),
        timeout: secs(p.timeout_seconds, 1),
        success_threshold: p
            .success_threshold
            .and_then(|v| u32::try_from(v).ok())
            .unwrap_or(1)
            .max(1),
        failure_threshold: p
            .failure_threshold
            .and_then(|v| u32::try_from(v).ok())
            .unwrap_or(3)
            .max(1),
    }))
}

/// The container's `preStop` hook, if it has one.
pub fn pre_stop(container: &Container) -> Result<Option<Handler>, String> {
    let Some(h): Option<&LifecycleHandler> = container
        .lifecycle
        .as_ref()
        .and_then(|l| l.pre_stop.as_ref())
    else {
        return Ok(None);
    };
    let field = format!("container {}: lifecycle.preStop", container.name);
    Ok(Some(if let Some(e) = &h.exec {
        exec(e)
    } else if let Some(g) = &h.http_get {
        http(g, container, &format!("{field}.httpGet"))?
    } else if let Some(t) = &h.tcp_socket {
        tcp(t, container, &format!("{field}.tcpSocket"))?
    } else if let Some(s) = &h.sleep {
        Handler::Sleep(Duration::from_secs(u64::try_from(s.seconds).unwrap_or(0)))
    } else {
        return Err(format!("{field}: no handler"));
    }))
}

/// One probe of one container instance: kubelet's probe worker's state.
#[derive(Debug, Clone)]
pub struct Worker {
    /// The probe.
    pub spec: ProbeSpec,
    /// The published result.
    pub result: bool,
    last: Option<bool>,
    run: u32,
    on_hold: bool,
    next_at: Instant,
}

impl Worker {
    /// The worker of a container instance that started at `started`.
    pub fn new(spec: ProbeSpec, started: Instant) -> Worker {
        Worker {
            result: spec.kind == Kind::Liveness,
            next_at: started + spec.initial_delay,
            spec,
            last: None,
            run: 0,
            on_hold: false,
        }
    }

    /// Whether a probe is due at `now` (the container running; a startup
    /// probe, once passed, and a probe on hold never are).
    pub fn due(&self, now: Instant) -> bool {
        let passed_startup = self.spec.kind == Kind::Startup && self.result;
        !self.on_hold && !passed_startup && now >= self.next_at
    }

    /// When the next probe is due.
    pub fn next_at(&self) -> Instant {
        self.next_at
    }

    /// A liveness or startup probe failed `failureThreshold` times in a
    /// row: the container is to be killed.
    pub fn failed(&self) -> bool {
        self.on_hold
    }

    /// Records a probe's outcome at `now`; `Some` when the published result
    /// changes.
    pub fn record(&mut self, success: bool, now: Instant) -> Option<bool> {
        self.next_at = now + self.spec.period;
        if self.last == Some(success) {
            self.run += 1;
        } else {
            self.last = Some(success);
            self.run = 1;
        }
        let threshold = if success {
            self.spec.success_threshold
        } else {
            self.spec.failure_threshold
        };
        if self.run < threshold {
            return None;
        }
        if !success && self.spec.kind != Kind::Readiness {
            self.on_hold = true;
            self.run = 0;
        }
        if self.result == success {
            return None;
        }
        self.result = success;
        Some(success)
    }
}

/// What a container instance's probes say of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Health {
    /// `started`: running, and its startup probe passed (or it has none).
    pub started: bool,
    /// `ready`: started, and its readiness probe passed (or it has none).
    pub ready: bool,
    /// Its liveness or startup probe failed: it is to be killed.
    pub unhealthy: bool,
}

/// The health of an instance of `container` (`running` or not) from the
/// probe workers of that instance (`worker`: `None` before its worker ran
/// or was made), as kubelet's prober manager reports it
/// (`UpdatePodStatus`, `isContainerStarted`): a probe the container has
/// counts only through a result of this instance's worker, and until then
/// holds at its initial result — not started, not ready; only a container
/// without a startup or readiness probe is started or ready once running.
pub fn health<'a>(
    container: &Container,
    running: bool,
    worker: impl Fn(Kind) -> Option<&'a Worker>,
) -> Health {
    let has = |kind| matches!(probe_spec(container, kind), Ok(Some(_)));
    let passed = |kind| !has(kind) || worker(kind).is_some_and(|w| w.result);
    let started = running && passed(Kind::Startup);
    Health {
        started,
        ready: started && passed(Kind::Readiness),
        unhealthy: running
            && [Kind::Startup, Kind::Liveness]
                .into_iter()
                .any(|k| worker(k).is_some_and(Worker::failed)),
    }
}

/// Runs `handler` against container `id` of the pod at `pod_ip` within
/// `timeout`; whether it passed, and what it said when it did not.
pub async fn run(
    handler: &Handler,
    cri: &CriClient,
    id: &str,
    pod_ip: IpAddr,
    timeout: Duration,
) -> Result<(), String> {
    match handler {
        Handler::Exec(command) => {
            let argv: Vec<&str> = command.iter().map(String::as_str).collect();
            let out = cri
                .exec_sync(id, &argv, timeout)
                .await
                .map_err(|e| format!("exec {command:?}: {e}"))?;
            if out.exit_code == 0 {
                Ok(())
            } else {
                Err(format!(
                    "exec {command:?}: exit code {}: {}",
                    out.exit_code,
                    String::from_utf8_lossy(&out.stdout)
                ))
            }
        }
        Handler::Http {
            host,
            port,
            path,
            headers,
        } => {
            let host = host.clone().unwrap_or_else(|| pod_ip.to_string());
            tokio::time::timeout(timeout, http_get(&host, *port, path, headers))
                .await
                .map_err(|_| {
                    format!("GET http://{host}:{port}{path}: timed out after {timeout:?}")
                })?
        }
        Handler::Tcp { host, port } => {
            let host = host.clone().unwrap_or_else(|| pod_ip.to_string());
            tokio::time::timeout(timeout, TcpStream::connect((host.as_str(), *port)))
                .await
                .map_err(|_| format!("dial {host}:{port}: timed out after {timeout:?}"))?
                .map(drop)
                .map_err(|e| format!("dial {host}:{port}: {e}"))
        }
        Handler::Sleep(d) => {
            tokio::time::sleep(*d).await;
            Ok(())
        }
    }
}

/// kubelet's HTTP probe: `GET` with its user agent; 200–399 pass.
async fn http_get(
    host: &str,
    port: u16,
    path: &str,
    headers: &[(String, String)],
) -> Result<(), String> {
    let url = format!("http://{host}:{port}{path}");
    let mut stream = TcpStream::connect((host, port))
        .await
        .map_err(|e| format!("GET {url}: {e}"))?;
    let mut request = format!("GET {path} HTTP/1.1\r\n");
    let has = |name: &str| headers.iter().any(|(n, _)| n.eq_ignore_ascii_case(name));
    if !has("host") {
        request.push_str(&format!("Host: {host}:{port}\r\n"));
    }
    if !has("user-agent") {
        request.push_str("User-Agent: kube-probe/1.30\r\n");
    }
    if !has("accept") {
        request.push_str("Accept: */*\r\n");
    }
    for (n, v) in headers {
        request.push_str(&format!("{n}: {v}\r\n"));
    }
    request.push_str("Connection: close\r\n\r\n");
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(|e| format!("GET {url}: {e}"))?;
    let mut head = Vec::new();
    let mut buf = [0u8; 512];
    while !head.windows(2).any(|w| w == b"\r\n") && head.len() < 4096 {
        let n = stream
            .read(&mut buf)
            .await
            .map_err(|e| format!("GET {url}: {e}"))?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    let line = String::from_utf8_lossy(&head);
    let code: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("GET {url}: no HTTP status in {line:?}"))?;
    if (200..400).contains(&code) {
        Ok(())
    } else {
        Err(format!(
            "GET {url}: HTTP probe failed with statuscode: {code}"
        ))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn spec(kind: Kind, success: u32, failure: u32) -> ProbeSpec {
        ProbeSpec {
            kind,
            handler: Handler::Exec(vec!["true".into()]),
            initial_delay: Duration::from_secs(5),
            period: Duration::from_secs(10),
            timeout: Duration::from_secs(1),
            success_threshold: success,
            failure_threshold: failure,
        }
    }

    #[test]
    fn readiness_starts_failed_and_flips_after_the_thresholds() {
        let t0 = Instant::now();
        let mut w = Worker::new(spec(Kind::Readiness, 2, 3), t0);
        assert!(!w.result);
        assert!(!w.due(t0), "initial delay");
        assert!(w.due(t0 + Duration::from_secs(5)));
        assert_eq!(w.record(true, t0), None, "one success of two");
        assert!(!w.due(t0 + Duration::from_secs(9)), "period");
        assert_eq!(w.record(true, t0), Some(true));
        assert_eq!(w.record(false, t0), None);
        assert_eq!(w.record(true, t0), None, "a success breaks the failure run");
        assert_eq!(w.record(false, t0), None);
        assert_eq!(w.record(false, t0), None);
        assert_eq!(w.record(false, t0), Some(false));
        // Readiness keeps probing after failing.
        assert!(w.due(t0 + Duration::from_secs(10)));
    }

    #[test]
    fn liveness_starts_passed_and_holds_once_failed() {
        let t0 = Instant::now();
        let mut w = Worker::new(spec(Kind::Liveness, 1, 2), t0);
        assert!(w.result);
        assert_eq!(w.record(true, t0), None);
        assert_eq!(w.record(false, t0), None);
        assert_eq!(w.record(false, t0), Some(false));
        assert!(w.failed());
        assert!(
            !w.due(t0 + Duration::from_secs(3600)),
            "on hold until replaced"
        );
    }

    #[test]
    fn a_startup_probe_stops_once_passed() {
        let t0 = Instant::now();
        let mut w = Worker::new(spec(Kind::Startup, 1, 3), t0);
        assert!(!w.result);
        assert_eq!(w.record(true, t0), Some(true));
        assert!(!w.due(t0 + Duration::from_secs(3600)));
        let mut w = Worker::new(spec(Kind::Startup, 1, 2), t0);
        assert_eq!((w.record(false, t0), w.record(false, t0)), (None, None));
        assert!(w.failed());
    }

    #[test]
    fn a_probe_holds_its_initial_result_until_its_instance_is_probed() {
        let c: Container = serde_json::from_value(serde_json::json!({
            "name": "app",
            "startupProbe": {"exec": {"command": ["true"]}},
            "readinessProbe": {"exec": {"command": ["test", "-f", "/tmp/ready"]}},
            "livenessProbe": {"exec": {"command": ["true"]}},
        }))
        .unwrap_or_else(|e| panic!("{e}"));
        let t0 = Instant::now();
        let workers: HashMap<Kind, Worker> = [Kind::Startup, Kind::Readiness, Kind::Liveness]
            .into_iter()
            .map(|k| {
                let s = probe_spec(&c, k)
                    .ok()
                    .flatten()
                    .unwrap_or_else(|| panic!("{k:?}"));
                (k, Worker::new(s, t0))
            })
            .collect();
        let none = |_| None;
        let h = health(&c, true, none);
        assert_eq!(
            h,
            Health {
                started: false,
                ready: false,
                unhealthy: false
            },
            "no worker yet: the initial results"
        );
        let mut workers = workers;
        let h = health(&c, true, |k| workers.get(&k));
        assert!(!h.started && !h.ready && !h.unhealthy, "{h:?}");
        if let Some(w) = workers.get_mut(&Kind::Startup) {
            w.record(true, t0);
        }
        let h = health(&c, true, |k| workers.get(&k));
        assert!(
            h.started && !h.ready,
            "started, the readiness probe not passed yet: {h:?}"
        );
        if let Some(w) = workers.get_mut(&Kind::Readiness) {
            w.record(true, t0);
        }
        assert!(health(&c, true, |k| workers.get(&k)).ready);
        assert!(!health(&c, false, |k| workers.get(&k)).ready, "not running");
        // Without probes: started and ready once running.
        let plain = Container {
            name: "plain".into(),
            ..Default::default()
        };
        let h = health(&plain, true, none);
        assert!(h.started && h.ready && !h.unhealthy, "{h:?}");
        assert!(!health(&plain, false, none).started);
    }

    #[test]
    fn probe_specs_default_resolve_named_ports_and_refuse_what_is_unsupported() {
        let c: Container = serde_json::from_value(serde_json::json!({
            "name": "web",
            "ports": [{"name": "http", "containerPort": 8080}],
            "readinessProbe": {"httpGet": {"port": "http", "path": "/healthz"}},
            "livenessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 2},
            "startupProbe": {"grpc": {"port": 9000}},
        }))
        .unwrap_or_else(|e| panic!("{e}"));
        let r = probe_spec(&c, Kind::Readiness).unwrap_or_else(|e| panic!("{e}"));
        let r = r.unwrap_or_else(|| panic!("no readiness probe"));
        assert_eq!(
            r.handler,
            Handler::Http {
                host: None,
                port: 8080,
                path: "/healthz".into(),
                headers: Vec::new()
            }
        );
        assert_eq!(
            (
                r.period,
                r.timeout,
                r.success_threshold,
                r.failure_threshold
            ),
            (Duration::from_secs(10), Duration::from_secs(1), 1, 3)
        );
        let l = probe_spec(&c, Kind::Liveness).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(l.map(|l| l.period), Some(Duration::from_secs(2)));
        let err = probe_spec(&c, Kind::Startup).err().unwrap_or_default();
        assert!(err.contains("container web: startupProbe.grpc"), "{err}");
    }
}
