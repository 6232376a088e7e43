//! `kubectl port-forward`'s path, as containerd 1.6's CRI PortForward
//! takes it (`sandbox_portforward_linux.go`): a thread enters the pod's
//! network namespace and dials `127.0.0.1:<port>` there. The pod's server
//! (busybox `httpd`) listens on 127.0.0.1 only, so only the pod's own
//! loopback reaches it: under runc that is the namespace's; under twig the
//! guest's, reached through the shim's port-forward (twig-net's sk_lookup
//! listener, the agent's vsock listener). A port nothing listens on is
//! refused under runc and reset under twig (the dial succeeds on the host,
//! the guest refuses): either way no bytes come back and containerd's copy
//! ends with an error. Built with `--features lab` and run in the nested
//! lab by `tests/lab/run.sh -p twig-e2e --features twig-e2e/lab --test
//! port_forward`.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

use twig_cri::container_config;
use twig_e2e::cri::CriNode;
use twig_e2e::crilab::{runtime, CriLab};
use twig_e2e::IMAGE_REF;

/// The port the pod's server listens on, on 127.0.0.1 only.
const PORT: u16 = 8080;
/// How long the server may take to come up (TCG).
const UP: Duration = Duration::from_secs(180);
/// One dial and its answer.
const ONE: Duration = Duration::from_secs(30);

/// Runs `work` on a thread inside the network namespace `netns`.
fn in_netns<T: Send>(netns: &Path, work: impl FnOnce() -> T + Send) -> T {
    let file = std::fs::File::open(netns).unwrap_or_else(|e| panic!("{}: {e}", netns.display()));
    std::thread::scope(|s| {
        s.spawn(|| {
            nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET)
                .unwrap_or_else(|e| panic!("entering {}: {e}", netns.display()));
            work()
        })
        .join()
        .unwrap_or_else(|_| panic!("the thread in {} panicked", netns.display()))
    })
}

/// What containerd does: dial `127.0.0.1:port` in the pod's namespace,
/// then send an HTTP request and read everything back.
fn get(netns: &Path, port: u16) -> std::io::Result<String> {
    in_netns(netns, || {
        let to = SocketAddr::from(([127, 0, 0, 1], port));
        let mut s = TcpStream::connect_timeout(&to, ONE)?;
        s.set_read_timeout(Some(ONE))?;
        s.write_all(b"GET /index.html HTTP/1.0\r\n\r\n")?;
        let mut back = Vec::new();
        s.read_to_end(&mut back)?;
        Ok(String::from_utf8_lossy(&back).into_owned())
    })
}

fn forward(handler: &str) {
    runtime().block_on(scenario(handler));
}

async fn scenario(handler: &str) {
    let lab = CriLab::start().await;
    let pod = lab
        .node
        .pod_config("forward")
        .unwrap_or_else(|e| panic!("{e}"));
    let script = format!(
        "mkdir -p /www && echo forwarded-from-the-pod > /www/index.html && \
         exec httpd -f -p 127.0.0.1:{PORT} -h /www"
    );
    let config = container_config("web", IMAGE_REF, &["/bin/sh", "-c", &script], "web.log");
    let (pod_id, _) = lab.run_pod(&pod, handler, &config).await;
    let namespaces = CriNode::cni_netns();
    let [netns] = namespaces.as_slice() else {
        panic!("one pod, one CNI namespace: {namespaces:?}");
    };

    // Until httpd is up a dial is refused (runc) or reset (twig).
    let deadline = Instant::now() + UP;
    let page = loop {
        match get(netns, PORT) {
            Ok(page) if page.contains("forwarded-from-the-pod") => break page,
            // Polled: nothing says when httpd listens.
            _ if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(200)).await,
            other => panic!(
                "{handler}: the pod's 127.0.0.1:{PORT} never answered: {other:?}\n{}",
                lab.logs()
            ),
        }
    };
    assert!(
        page.starts_with("HTTP/1.") && page.lines().next().is_some_and(|l| l.contains(" 200 ")),
        "{handler}: {page}"
    );

    // In a row: each its own connection.
    for _ in 0..3 {
        let page = get(netns, PORT).unwrap_or_else(|e| panic!("{handler}: {e}"));
        assert!(page.contains("forwarded-from-the-pod"), "{handler}: {page}");
    }

    // Nothing listens on PORT + 1.
    match (handler, get(netns, PORT + 1)) {
        ("runc", Err(e)) => assert_eq!(e.kind(), ErrorKind::ConnectionRefused, "{e}"),
        (_, Err(e)) => assert_eq!(e.kind(), ErrorKind::ConnectionReset, "{handler}: {e}"),
        (_, Ok(page)) => panic!("{handler}: a closed port answered {page:?}"),
    }

    lab.remove_pod(&pod_id).await;
}

#[test]
fn twig_forwards_the_pods_loopback_port() {
    forward("twig");
}

#[test]
fn runc_forwards_the_pods_loopback_port() {
    forward("runc");
}
