//! What kubectl does through kubelet's streaming URLs, here through
//! containerd 1.6's CRI streaming server directly (CRI `Exec`, `Attach`,
//! `PortForward` hand out a URL; a WebSocket client with kubelet's
//! `v4.channel.k8s.io` protocol takes it, as kubectl's WebSocket clients
//! do), on twig and on runc (the reference) with the same results:
//! - `kubectl exec`: stdout, stderr and the exit code (the status channel);
//! - `kubectl attach`: a line sent to the container's own stdin comes back
//!   on its stdout, again after a detach and a second attach;
//! - `kubectl cp` both ways: a tar archive streamed into `tar xf -` (v4
//!   cannot close stdin, so the container reads exactly the archive's
//!   10,240 bytes, one tar record), and `tar cf -` streamed back;
//! - `kubectl debug --target`: an ephemeral container in the target's
//!   process namespace sees its processes, and is attached to; on twig a
//!   target among several running containers is refused (every twig task
//!   reports the shim's pid, so CRI's path cannot name the target);
//! - `kubectl port-forward`: an HTTP request to the pod's 127.0.0.1-only
//!   server through the PortForward URL.
//!
//! Built with `--features lab` and run in the nested lab by
//! `tests/lab/run.sh -p twig-e2e --features twig-e2e/lab --test streaming`.

use std::time::{Duration, Instant};

use futures::{SinkExt, StreamExt};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::Message;
use twig_cri::{api, container_config};
use twig_e2e::crilab::{runtime, CriLab};
use twig_e2e::IMAGE_REF;

/// The port the pod's server listens on, on 127.0.0.1 only.
const PORT: u16 = 8080;
/// How long one stream may take (TCG).
const STREAM: Duration = Duration::from_secs(120);
/// kubelet's channel protocol, version 4: each binary frame's first byte
/// names its channel.
const PROTOCOL: &str = "v4.channel.k8s.io";
/// The channels of exec and attach.
const STDIN: u8 = 0;
const STDOUT: u8 = 1;
const STDERR: u8 = 2;
const STATUS: u8 = 3;

type Socket =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// A WebSocket on a streaming URL, speaking [`PROTOCOL`].
struct Stream {
    ws: Socket,
}

/// What a stream carried until it closed: bytes per channel.
#[derive(Debug, Default)]
struct Received {
    channels: [Vec<u8>; 5],
}

impl Received {
    fn text(&self, channel: u8) -> String {
        String::from_utf8_lossy(&self.channels[usize::from(channel)]).into_owned()
    }
}

impl Stream {
    async fn open(url: &str) -> Stream {
        let ws_url = url.replacen("http://", "ws://", 1);
        let mut req = ws_url
            .as_str()
            .into_client_request()
            .unwrap_or_else(|e| panic!("{ws_url}: {e}"));
        req.headers_mut()
            .insert("Sec-WebSocket-Protocol", HeaderValue::from_static(PROTOCOL));
        let (ws, resp) = tokio::time::timeout(STREAM, tokio_tungstenite::connect_async(req))
            .await
            .unwrap_or_else(|_| panic!("{ws_url}: no answer in {STREAM:?}"))
            .unwrap_or_else(|e| panic!("{ws_url}: {e}"));
        assert_eq!(
            resp.headers()
                .get("Sec-WebSocket-Protocol")
                .and_then(|v| v.to_str().ok()),
            Some(PROTOCOL),
            "the streaming server speaks {PROTOCOL}"
        );
        Stream { ws }
    }

    async fn send(&mut self, channel: u8, data: &[u8]) {
        let mut frame = vec![channel];
        frame.extend_from_slice(data);
        self.ws
            .send(Message::binary(frame))
            .await
            .unwrap_or_else(|e| panic!("sending on channel {channel}: {e}"));
    }

    /// Frames until `done` holds of what arrived or the stream closes;
    /// within [`STREAM`].
    async fn until(&mut self, done: impl Fn(&Received) -> bool) -> Received {
        let mut got = Received::default();
        let deadline = Instant::now() + STREAM;
        while !done(&got) {
            let left = deadline.saturating_duration_since(Instant::now());
            let next = tokio::time::timeout(left, self.ws.next())
                .await
                .unwrap_or_else(|_| panic!("nothing more within {STREAM:?}; got {got:?}"));
            match next {
                None | Some(Ok(Message::Close(_))) => break,
                Some(Ok(Message::Binary(b))) => {
                    if let Some((&ch, data)) = b.split_first() {
                        if let Some(buf) = got.channels.get_mut(usize::from(ch)) {
                            buf.extend_from_slice(data);
                        }
                    }
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => panic!("the stream failed: {e}; got {got:?}"),
            }
        }
        got
    }

    /// Everything until the server closes the stream.
    async fn until_closed(&mut self) -> Received {
        self.until(|_| false).await
    }

    async fn close(mut self) {
        let _ = self.ws.close(None).await;
    }
}

/// The exit code a v4 status says: 0 for `Success`, else the
/// `ExitCode` cause's.
fn exit_code(status: &str) -> i32 {
    let v: serde_json::Value =
        serde_json::from_str(status).unwrap_or_else(|e| panic!("status {status:?}: {e}"));
    if v["status"] == "Success" {
        return 0;
    }
    v["details"]["causes"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["reason"] == "ExitCode")
        .and_then(|c| c["message"].as_str())
        .and_then(|m| m.parse().ok())
        .unwrap_or_else(|| panic!("no exit code in {status}"))
}

/// A ustar archive of one file `name` (under 100 bytes) holding `data`,
/// padded as tar pads an archive: 10,240 bytes, one record.
fn archive(name: &str, data: &[u8]) -> Vec<u8> {
    let mut header = [0u8; 512];
    let field = |h: &mut [u8; 512], at: usize, value: &[u8]| {
        h[at..at + value.len()].copy_from_slice(value);
    };
    field(&mut header, 0, name.as_bytes());
    field(&mut header, 100, b"0000644\0");
    field(&mut header, 108, b"0000000\0");
    field(&mut header, 116, b"0000000\0");
    field(
        &mut header,
        124,
        format!("{:011o}\0", data.len()).as_bytes(),
    );
    field(&mut header, 136, b"00000000000\0");
    field(&mut header, 156, b"0");
    field(&mut header, 257, b"ustar\x0000");
    // The checksum is summed with its own field as spaces.
    field(&mut header, 148, b"        ");
    let sum: u32 = header.iter().map(|b| u32::from(*b)).sum();
    field(&mut header, 148, format!("{sum:06o}\0 ").as_bytes());
    let mut out = header.to_vec();
    out.extend_from_slice(data);
    out.resize(out.len().div_ceil(512) * 512, 0);
    out.resize(10240, 0);
    out
}

fn streaming(handler: &str) {
    runtime().block_on(scenario(handler));
}

async fn scenario(handler: &str) {
    let lab = CriLab::start().await;
    let pod = lab
        .node
        .pod_config(&format!("stream-{handler}"))
        .unwrap_or_else(|e| panic!("{e}"));
    let mut echo = container_config(
        "echo",
        IMAGE_REF,
        &[
            "/bin/sh",
            "-c",
            "echo ready; while read l; do echo got:$l; done",
        ],
        "echo.log",
    );
    echo.stdin = true;
    // As kubelet runs a pod without shareProcessNamespace: each container
    // its own process namespace.
    echo.linux = Some(own_pid_namespace(None));
    let (pod_id, echo_id) = lab.run_pod(&pod, handler, &echo).await;

    // exec: both outputs and the exit code.
    let url = lab
        .cri
        .exec_url(
            &echo_id,
            &["sh", "-c", "echo to-stdout; echo to-stderr >&2; exit 3"],
            false,
            false,
        )
        .await
        .unwrap_or_else(|e| lab.fail("Exec", e));
    let got = Stream::open(&url).await.until_closed().await;
    assert_eq!(got.text(STDOUT), "to-stdout\n", "{handler}: {got:?}");
    assert_eq!(got.text(STDERR), "to-stderr\n", "{handler}: {got:?}");
    assert_eq!(exit_code(&got.text(STATUS)), 3, "{handler}: {got:?}");

    // attach: the container's own stdin and stdout, twice.
    for word in ["hello", "again"] {
        let url = lab
            .cri
            .attach_url(&echo_id, true)
            .await
            .unwrap_or_else(|e| lab.fail("Attach", e));
        let mut s = Stream::open(&url).await;
        s.send(STDIN, format!("{word}\n").as_bytes()).await;
        let want = format!("got:{word}\n");
        let got = s.until(|r| r.text(STDOUT).contains(&want)).await;
        assert!(got.text(STDOUT).contains(&want), "{handler}: {got:?}");
        s.close().await;
    }

    // cp into the pod: the archive on stdin, unpacked.
    let payload = b"copied in through the exec stream\n";
    let url = lab
        .cri
        .exec_url(
            &echo_id,
            &["sh", "-c", "head -c 10240 | tar xf - -C /tmp"],
            true,
            false,
        )
        .await
        .unwrap_or_else(|e| lab.fail("Exec tar xf", e));
    let mut s = Stream::open(&url).await;
    s.send(STDIN, &archive("copied.txt", payload)).await;
    let got = s.until_closed().await;
    assert_eq!(exit_code(&got.text(STATUS)), 0, "{handler}: {got:?}");
    let (code, out) = lab.exec(&echo_id, &["cat", "/tmp/copied.txt"]).await;
    assert_eq!(
        (code, out.as_str()),
        (0, "copied in through the exec stream"),
        "{handler}"
    );

    // cp out of the pod: `tar cf -` on stdout.
    let url = lab
        .cri
        .exec_url(
            &echo_id,
            &["tar", "cf", "-", "-C", "/tmp", "copied.txt"],
            false,
            false,
        )
        .await
        .unwrap_or_else(|e| lab.fail("Exec tar cf", e));
    let got = Stream::open(&url).await.until_closed().await;
    let tar = &got.channels[usize::from(STDOUT)];
    assert!(tar.len() >= 1024, "{handler}: {} bytes", tar.len());
    assert_eq!(&tar[..10], b"copied.txt", "{handler}: the entry's name");
    assert_eq!(
        &tar[512..512 + payload.len()],
        payload,
        "{handler}: its data"
    );
    assert_eq!(exit_code(&got.text(STATUS)), 0, "{handler}");

    // kubectl debug --target: an ephemeral container in the target's
    // process namespace, attached.
    let mut debug = container_config("debugger", IMAGE_REF, &["/bin/sh"], "debugger.log");
    debug.stdin = true;
    debug.linux = Some(own_pid_namespace(Some(&echo_id)));
    let debug_id = lab.add_container(&pod_id, &pod, &debug).await;
    let url = lab
        .cri
        .attach_url(&debug_id, true)
        .await
        .unwrap_or_else(|e| lab.fail("Attach debugger", e));
    let mut s = Stream::open(&url).await;
    s.send(STDIN, b"tr '\\0' ' ' < /proc/1/cmdline; echo\n")
        .await;
    let got = s.until(|r| r.text(STDOUT).contains("while read")).await;
    assert!(
        got.text(STDOUT).contains("echo ready; while read l"),
        "{handler}: the debugger sees the target's processes: {got:?}"
    );
    s.close().await;

    // port-forward: the pod's 127.0.0.1-only server.
    let script = format!(
        "mkdir -p /www && echo forwarded-from-the-pod > /www/index.html && \
         exec httpd -f -p 127.0.0.1:{PORT} -h /www"
    );
    let mut web = container_config("web", IMAGE_REF, &["/bin/sh", "-c", &script], "web.log");
    web.linux = Some(own_pid_namespace(None));
    let web_id = lab.add_container(&pod_id, &pod, &web).await;
    let deadline = Instant::now() + STREAM;
    loop {
        let url = lab
            .cri
            .port_forward_url(&pod_id, &[PORT])
            .await
            .unwrap_or_else(|e| lab.fail("PortForward", e));
        let mut s = Stream::open(&url).await;
        s.send(0, b"GET /index.html HTTP/1.0\r\n\r\n").await;
        // Channel 0 carries the data (after the port's 2 bytes), 1 errors.
        let got = s
            .until(|r| String::from_utf8_lossy(&r.channels[0]).contains("forwarded-from-the-pod"))
            .await;
        let page = String::from_utf8_lossy(&got.channels[0]).into_owned();
        if page.contains("forwarded-from-the-pod") {
            assert!(page.contains(" 200 "), "{handler}: {page}");
            break;
        }
        // Polled: nothing says when httpd listens; until then the
        // forward's error channel says why.
        assert!(
            Instant::now() < deadline,
            "{handler}: port-forward never answered: {got:?}\n{}",
            lab.logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // With two containers running, a target is ambiguous to twig (every
    // task reports the shim's pid): refused, naming the way out.
    let mut second = container_config("debugger-2", IMAGE_REF, &["/bin/sh"], "debugger-2.log");
    second.linux = Some(own_pid_namespace(Some(&web_id)));
    let created = lab.cri.create_container(&pod_id, &second, &pod).await;
    let started = match created {
        Ok(id) => lab.cri.start_container(&id).await,
        Err(e) => Err(e),
    };
    match (handler, started) {
        ("runc", r) => {
            r.unwrap_or_else(|e| lab.fail("a second debugger", e));
        }
        (_, Ok(())) => panic!("{handler}: an ambiguous target was accepted"),
        (_, Err(e)) => assert!(
            e.to_string().contains("shareProcessNamespace"),
            "{handler}: {e}"
        ),
    }

    lab.remove_pod(&pod_id).await;
}

/// A container's Linux config as kubelet gives it in a pod without
/// `shareProcessNamespace`: a process namespace of its own, or (an
/// ephemeral container with a target) container `target`'s.
fn own_pid_namespace(target: Option<&str>) -> api::LinuxContainerConfig {
    let (pid, target_id) = match target {
        Some(t) => (api::NamespaceMode::Target, t.to_string()),
        None => (api::NamespaceMode::Container, String::new()),
    };
    api::LinuxContainerConfig {
        security_context: Some(api::LinuxContainerSecurityContext {
            namespace_options: Some(api::NamespaceOption {
                pid: pid as i32,
                target_id,
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[test]
fn twig_streams_exec_attach_cp_and_port_forward() {
    streaming("twig");
}

#[test]
fn runc_streams_exec_attach_cp_and_port_forward() {
    streaming("runc");
}
