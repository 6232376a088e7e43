//! Issue 12's CRI path through containerd's own CRI plugin, driven with
//! twig-cri's client as kubelet drives it: RunPodSandbox on a CNI bridge →
//! CreateContainer ×3 (each its own rootfs on the twig snapshotter) →
//! StartContainer → their output in the CRI logs → ExecSync → ContainerStats
//! → StopContainer → StopPodSandbox → RemovePodSandbox, and nothing left
//! behind. Once with the runtime handler `twig` (one microVM for the pod,
//! on the pod's network: its IP answers TCP and ping from the node, the
//! guest has the pod's IP and the veth's MAC, the metadata address is
//! unreachable), once with `runc`, the reference.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use twig_cri::api::{ContainerState, PodSandboxState};
use twig_cri::{container_config, logs};
use twig_e2e::cri::{mac_in_netns, CriNode};
use twig_e2e::crilab::accept_line;
use twig_e2e::IMAGE_REF;

const HTTP_PORT: u16 = 8080;
/// How long a container's first output may take in the lab.
const OUTPUT: Duration = Duration::from_secs(120);
/// ExecSync's own limit.
const EXEC: Duration = Duration::from_secs(120);
/// How long a removed pod's shim and VMM may take to go.
const GONE: Duration = Duration::from_secs(60);

/// GETs `/` from `ip:HTTP_PORT`, retrying until `within` passes.
fn http_get(ip: IpAddr, within: Duration) -> Result<String, String> {
    let addr = SocketAddr::new(ip, HTTP_PORT);
    let deadline = Instant::now() + within;
    let mut last = String::new();
    while Instant::now() < deadline {
        let attempt = (|| -> std::io::Result<String> {
            let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(1))?;
            s.set_read_timeout(Some(Duration::from_secs(5)))?;
            s.write_all(b"GET / HTTP/1.0\r\nHost: pod\r\n\r\n")?;
            let mut body = String::new();
            s.read_to_string(&mut body)?;
            Ok(body)
        })();
        match attempt {
            Ok(body) => return Ok(body),
            Err(e) => last = e.to_string(),
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Err(format!("{addr} did not answer within {within:?}: {last}"))
}

/// What differs between the handlers.
struct Expect {
    /// The runtime handler RunPodSandbox asks for.
    handler: &'static str,
    /// Whether the containers run on a kernel of their own (a microVM).
    own_kernel: bool,
    /// Whether the pod's IP answers from the host network namespace.
    pod_network: bool,
    /// The pod's `twig.dev/egress-policy` annotation allows its own subnet
    /// (the node's bridge address answers it).
    allow_subnet: bool,
}

/// Pings `ip` from the node until it answers or `within` passes.
fn ping(ip: IpAddr, within: Duration) -> Result<(), String> {
    let deadline = Instant::now() + within;
    let mut last = String::new();
    while Instant::now() < deadline {
        match std::process::Command::new("ping")
            .args(["-c", "1", "-W", "2", &ip.to_string()])
            .output()
        {
            Ok(o) if o.status.success() => return Ok(()),
            Ok(o) => last = String::from_utf8_lossy(&o.stdout).into_owned(),
            Err(e) => last = e.to_string(),
        }
    }
    Err(format!(
        "{ip} did not answer ping within {within:?}: {last}"
    ))
}

fn pod_lifecycle(expect: Expect) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("a tokio runtime: {e}"));
    rt.block_on(scenario(expect));
}

/// Says how far the scenario got (seen with `--nocapture`, e.g. in the
/// lab's console when a step hangs).
fn step(t0: Instant, what: &str) {
    eprintln!("cri: {:>7.2} s  {what}", t0.elapsed().as_secs_f64());
}

async fn scenario(expect: Expect) {
    let t0 = Instant::now();
    let node = CriNode::start().unwrap_or_else(|e| panic!("CRI node: {e}"));
    step(t0, "node up");
    let cri = node.client().await.unwrap_or_else(|e| panic!("{e}"));
    let fail = |what: &str, e: twig_cri::Error| -> ! { panic!("{}", node.cri_error(what, e)) };

    let mut pod = node
        .pod_config("lifecycle")
        .unwrap_or_else(|e| panic!("{e}"));
    if expect.allow_subnet {
        // The pod may open connections into its subnet (the node's bridge
        // address among them), which the default policy denies.
        pod.annotations.insert(
            "twig.dev/egress-policy".into(),
            format!(r#"{{"allow":[{{"cidr":"{}"}}]}}"#, node.net().subnet()),
        );
    }
    let pod_id = cri
        .run_pod_sandbox(&pod, expect.handler)
        .await
        .unwrap_or_else(|e| fail("RunPodSandbox", e));
    step(t0, "RunPodSandbox");
    let status = cri
        .pod_sandbox_status(&pod_id)
        .await
        .unwrap_or_else(|e| fail("PodSandboxStatus", e));
    assert_eq!(status.state(), PodSandboxState::SandboxReady);
    let ip = cri
        .pod_ip(&pod_id)
        .await
        .unwrap_or_else(|e| fail("the pod's IP", e));
    let IpAddr::V4(v4) = ip else {
        panic!("pod IP {ip} is not IPv4");
    };
    assert_eq!(
        v4.octets()[..3],
        node.net().gateway().octets()[..3],
        "pod IP {ip} outside {}",
        node.net().subnet()
    );
    assert_eq!(node.reserved_ips(), vec![ip]);

    // Three containers, each on its own rootfs (a snapshot of the same
    // image): a web server, one that writes to its rootfs and traps TERM,
    // one that only prints.
    let specs = [
        (
            "web",
            format!(
                "echo hello from web; mkdir -p /www && echo twig-web-ok > /www/index.html && \
                 exec httpd -f -p {HTTP_PORT} -h /www"
            ),
        ),
        (
            "writer",
            "trap 'echo writer got TERM; exit 3' TERM; echo hello from writer; \
             echo b-was-here > /own; while :; do sleep 3600 & wait $!; done"
                .to_string(),
        ),
        (
            "printer",
            "echo hello from printer; exec sleep 3600".to_string(),
        ),
    ];
    let mut ids = Vec::new();
    for (name, cmd) in &specs {
        let config = container_config(
            name,
            IMAGE_REF,
            &["/bin/sh", "-c", cmd],
            &format!("{name}.log"),
        );
        let id = cri
            .create_container(&pod_id, &config, &pod)
            .await
            .unwrap_or_else(|e| fail(&format!("CreateContainer {name}"), e));
        let status = cri
            .container_status(&id)
            .await
            .unwrap_or_else(|e| fail("ContainerStatus", e));
        assert_eq!(status.state(), ContainerState::ContainerCreated, "{name}");
        ids.push(id);
    }
    step(t0, "CreateContainer ×3");
    for (id, (name, _)) in ids.iter().zip(&specs) {
        cri.start_container(id)
            .await
            .unwrap_or_else(|e| fail(&format!("StartContainer {name}"), e));
    }
    step(t0, "StartContainer ×3");
    for (name, _) in &specs {
        let path = CriNode::container_log(&pod, &format!("{name}.log"));
        let want = format!("hello from {name}");
        let lines = logs::wait_for(&path, OUTPUT, |l| l.iter().any(|l| l.text == want))
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}\n{}", node.node().logs()));
        assert_eq!(lines[0].stream, "stdout", "{name}: {lines:?}");
    }
    step(t0, "their output in the CRI logs");
    let (web, writer, printer) = (&ids[0], &ids[1], &ids[2]);

    // ExecSync: both streams and the exit code; each container sees its
    // own rootfs.
    let out = cri
        .exec_sync(
            printer,
            &[
                "/bin/sh",
                "-c",
                "echo out; test -e /own && echo shared; echo oops >&2; exit 7",
            ],
            EXEC,
        )
        .await
        .unwrap_or_else(|e| fail("ExecSync", e));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "out\n");
    assert_eq!(String::from_utf8_lossy(&out.stderr), "oops\n");
    assert_eq!(out.exit_code, 7);
    let out = cri
        .exec_sync(writer, &["cat", "/own"], EXEC)
        .await
        .unwrap_or_else(|e| fail("ExecSync", e));
    assert_eq!(
        (String::from_utf8_lossy(&out.stdout).as_ref(), out.exit_code),
        ("b-was-here\n", 0)
    );
    // The kernel the containers see: the microVM's own, or the node's.
    let out = cri
        .exec_sync(web, &["cat", "/proc/version"], EXEC)
        .await
        .unwrap_or_else(|e| fail("ExecSync", e));
    let node_kernel = std::fs::read_to_string("/proc/version").unwrap_or_default();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout) != node_kernel,
        expect.own_kernel,
        "container's kernel: {:?}, node's: {node_kernel:?}",
        String::from_utf8_lossy(&out.stdout)
    );

    step(t0, "ExecSync ×3");
    // The pod's VMM (twig), to check it is gone at the end.
    let vmms = node.pod_vmms();
    assert_eq!(vmms.len(), usize::from(expect.own_kernel), "VMMs {vmms:?}");
    // The pod's IP answers from the host network namespace.
    if expect.pod_network {
        let body = http_get(ip, Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("{e}\n{}", node.node().logs()));
        assert!(
            body.starts_with("HTTP/1.") && body.contains("twig-web-ok"),
            "{body}"
        );
        ping(ip, Duration::from_secs(30)).unwrap_or_else(|e| panic!("{e}"));
        step(t0, "the pod's IP answers TCP and ping");
    }
    if expect.own_kernel && expect.pod_network {
        guest_network(&cri, web, ip, &node, expect.allow_subnet).await;
        step(t0, "the guest has the pod's identity; metadata unreachable");
    }

    // ContainerStats: the writer's own id, memory in use, CPU reported.
    let stats = cri
        .container_stats(writer)
        .await
        .unwrap_or_else(|e| fail("ContainerStats", e));
    assert_eq!(
        stats.attributes.as_ref().map(|a| a.id.as_str()),
        Some(writer.as_str())
    );
    let mem = stats
        .memory
        .and_then(|m| m.working_set_bytes)
        .map(|v| v.value);
    assert!(mem.is_some_and(|b| b > 0), "working set {mem:?}");
    assert!(
        stats.cpu.and_then(|c| c.usage_core_nano_seconds).is_some(),
        "no CPU usage"
    );

    step(t0, "ContainerStats");
    // StopContainer: TERM reaches the writer (its trap's exit code and
    // line); only that container exits.
    cri.stop_container(writer, Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| fail("StopContainer", e));
    let status = cri
        .container_status(writer)
        .await
        .unwrap_or_else(|e| fail("ContainerStatus", e));
    assert_eq!(status.state(), ContainerState::ContainerExited);
    assert_eq!(status.exit_code, 3, "{status:?}");
    logs::wait_for(&CriNode::container_log(&pod, "writer.log"), OUTPUT, |l| {
        l.iter().any(|l| l.text == "writer got TERM")
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    for id in [web, printer] {
        let status = cri
            .container_status(id)
            .await
            .unwrap_or_else(|e| fail("ContainerStatus", e));
        assert_eq!(
            status.state(),
            ContainerState::ContainerRunning,
            "{}",
            status.id
        );
    }

    step(t0, "StopContainer");
    // StopPodSandbox: every container exits, the pod is not ready, CNI
    // frees its address (and the IP stops answering).
    cri.stop_pod_sandbox(&pod_id)
        .await
        .unwrap_or_else(|e| fail("StopPodSandbox", e));
    let status = cri
        .pod_sandbox_status(&pod_id)
        .await
        .unwrap_or_else(|e| fail("PodSandboxStatus", e));
    assert_eq!(status.state(), PodSandboxState::SandboxNotready);
    for id in &ids {
        let status = cri
            .container_status(id)
            .await
            .unwrap_or_else(|e| fail("ContainerStatus", e));
        assert_eq!(
            status.state(),
            ContainerState::ContainerExited,
            "{}",
            status.id
        );
    }
    // The two still running were killed by the pod's stop (SIGKILL: 137),
    // not lost with their VM (255) when the writer was removed.
    for id in [web, printer] {
        let status = cri
            .container_status(id)
            .await
            .unwrap_or_else(|e| fail("ContainerStatus", e));
        assert_eq!(status.exit_code, 137, "{status:?}");
    }
    if expect.pod_network {
        assert!(
            http_get(ip, Duration::from_millis(500)).is_err(),
            "{ip} still answers"
        );
    }
    assert!(
        node.reserved_ips().is_empty(),
        "CNI kept {:?}",
        node.reserved_ips()
    );

    step(t0, "StopPodSandbox");
    // RemovePodSandbox: pod and containers are gone, and so are their
    // shim, VMM, mounts and network namespace.
    cri.remove_pod_sandbox(&pod_id)
        .await
        .unwrap_or_else(|e| fail("RemovePodSandbox", e));
    let err = cri.pod_sandbox_status(&pod_id).await.err();
    assert_eq!(
        err.as_ref().and_then(|e| e.code()),
        Some(tonic::Code::NotFound),
        "{err:?}"
    );
    for id in &ids {
        let err = cri.container_status(id).await.err();
        assert_eq!(
            err.as_ref().and_then(|e| e.code()),
            Some(tonic::Code::NotFound),
            "{err:?}"
        );
    }
    assert!(cri
        .list_pod_sandboxes()
        .await
        .unwrap_or_else(|e| fail("ListPodSandbox", e))
        .is_empty());
    step(t0, "RemovePodSandbox");
    node.expect_nothing_left(&vmms, GONE, "RemovePodSandbox")
        .await;
    step(t0, "nothing left behind");
}

/// Inside a twig pod (through ExecSync in `container`): the guest's
/// `eth0` has the pod's IP and the MAC of the pod's veth; the node's
/// bridge address answers when the pod's policy allows the subnet
/// (`allow_subnet`) and is unreachable under the default policy (a private
/// address); the metadata address is unreachable whatever the policy.
async fn guest_network(
    cri: &twig_cri::CriClient,
    container: &str,
    ip: IpAddr,
    node: &CriNode,
    allow_subnet: bool,
) {
    let fail = |what: &str, e: twig_cri::Error| -> ! { panic!("{}", node.cri_error(what, e)) };
    let namespaces = CriNode::cni_netns();
    let [netns] = namespaces.as_slice() else {
        panic!("one pod, one CNI namespace: {namespaces:?}");
    };
    let veth_mac = mac_in_netns(netns, "eth0").unwrap_or_else(|e| panic!("{e}"));
    let out = cri
        .exec_sync(container, &["cat", "/sys/class/net/eth0/address"], EXEC)
        .await
        .unwrap_or_else(|e| fail("ExecSync", e));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), veth_mac);
    let out = cri
        .exec_sync(container, &["ip", "addr", "show", "eth0"], EXEC)
        .await
        .unwrap_or_else(|e| fail("ExecSync", e));
    let shown = String::from_utf8_lossy(&out.stdout);
    let prefix = node.net().subnet();
    let prefix = prefix.rsplit('/').next().unwrap_or("24");
    assert!(shown.contains(&format!("inet {ip}/{prefix}")), "{shown}");
    let route = cri
        .exec_sync(container, &["ip", "route"], EXEC)
        .await
        .unwrap_or_else(|e| fail("ExecSync", e));
    let route = String::from_utf8_lossy(&route.stdout).into_owned();
    assert!(
        route.contains(&format!("default via {}", node.net().gateway())),
        "{route}"
    );
    // The node's bridge address: reached, and the answer comes back, when
    // the annotation allows the subnet; never under the default policy.
    let gateway = node.net().gateway();
    let listener =
        TcpListener::bind((gateway, 0)).unwrap_or_else(|e| panic!("listen on {gateway}: {e}"));
    let port = listener.local_addr().map(|a| a.port()).unwrap_or_default();
    let within = if allow_subnet { 60 } else { 15 };
    let accepted = std::thread::spawn(move || accept_line(&listener, Duration::from_secs(within)));
    let out = cri
        .exec_sync(
            container,
            &[
                "/bin/sh",
                "-c",
                &format!("echo from-the-pod | nc -w 5 {gateway} {port} 2>&1; echo rc=$?"),
            ],
            EXEC,
        )
        .await
        .unwrap_or_else(|e| fail("ExecSync", e));
    let got = accepted
        .join()
        .unwrap_or_else(|_| Err("the accept thread panicked".into()));
    let said = String::from_utf8_lossy(&out.stdout);
    if allow_subnet {
        assert_eq!(
            got.as_deref().map(str::trim),
            Ok("from-the-pod"),
            "the node got {got:?}; the pod said {said:?}"
        );
    } else {
        assert!(
            got.is_err() && !said.contains("rc=0"),
            "the default policy let the pod reach the node: {got:?}; the pod said {said:?}"
        );
    }
    // The metadata address is denied whatever the policy: the connection
    // never completes.
    let t = Instant::now();
    let out = cri
        .exec_sync(
            container,
            &[
                "/bin/sh",
                "-c",
                "nc -w 3 169.254.169.254 80 </dev/null 2>&1; echo rc=$?",
            ],
            EXEC,
        )
        .await
        .unwrap_or_else(|e| fail("ExecSync", e));
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("rc=") && !said.contains("rc=0"), "{said}");
    assert!(
        t.elapsed() >= Duration::from_secs(2),
        "refused at once, not dropped: {said} (routes: {route})"
    );
}

#[test]
fn twig_pod_with_three_containers_through_cri() {
    pod_lifecycle(Expect {
        handler: "twig",
        own_kernel: true,
        pod_network: true,
        // The default egress policy: the node's requests get answers
        // (twig-net tracks replies), the pod cannot open connections to
        // the node.
        allow_subnet: false,
    });
}

#[test]
fn twig_pod_whose_policy_allows_its_subnet_through_cri() {
    pod_lifecycle(Expect {
        handler: "twig",
        own_kernel: true,
        pod_network: true,
        allow_subnet: true,
    });
}

/// A twig pod whose shim is killed: containerd's `delete` of the dead
/// shim tears the pod's network path down (its pins recorded in the
/// shim's state), and StopPodSandbox + RemovePodSandbox leave nothing.
#[test]
fn a_twig_pod_whose_shim_died_leaves_no_network_behind() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("a tokio runtime: {e}"));
    rt.block_on(async {
        let t0 = Instant::now();
        let node = CriNode::start().unwrap_or_else(|e| panic!("CRI node: {e}"));
        let cri = node.client().await.unwrap_or_else(|e| panic!("{e}"));
        let fail = |what: &str, e: twig_cri::Error| -> ! { panic!("{}", node.cri_error(what, e)) };
        let pod = node.pod_config("orphan").unwrap_or_else(|e| panic!("{e}"));
        let pod_id = cri
            .run_pod_sandbox(&pod, "twig")
            .await
            .unwrap_or_else(|e| fail("RunPodSandbox", e));
        let ip = cri
            .pod_ip(&pod_id)
            .await
            .unwrap_or_else(|e| fail("the pod's IP", e));
        ping(ip, Duration::from_secs(30)).unwrap_or_else(|e| panic!("{e}"));
        let pinned = node.pinned_pod_networks();
        assert_eq!(pinned.len(), 1, "one pod, one pinned path: {pinned:?}");
        let vmms = node.pod_vmms();
        let shims = node.twig_shims();
        assert_eq!(shims.len(), 1, "one pod, one shim: {shims:?}");
        step(t0, "a networked twig pod");
        for pid in &shims {
            let pid = i32::try_from(*pid).unwrap_or_else(|e| panic!("pid {pid}: {e}"));
            nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            )
            .unwrap_or_else(|e| panic!("killing the shim {pid}: {e}"));
        }
        step(t0, "its shim killed");
        cri.stop_pod_sandbox(&pod_id)
            .await
            .unwrap_or_else(|e| fail("StopPodSandbox", e));
        cri.remove_pod_sandbox(&pod_id)
            .await
            .unwrap_or_else(|e| fail("RemovePodSandbox", e));
        node.expect_nothing_left(&vmms, GONE, "the shim died and the pod was removed")
            .await;
        step(t0, "nothing left behind");
    });
}

#[test]
fn runc_pod_with_three_containers_through_cri() {
    pod_lifecycle(Expect {
        handler: "runc",
        own_kernel: false,
        pod_network: true,
        allow_subnet: false,
    });
}
