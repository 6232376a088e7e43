//! The CRI path of issue 12, with runc as the runtime handler, through the
//! real containerd CRI plugin: images pulled from a local registry, a pod on
//! a CNI bridge, three containers each on its own rootfs, exec, stats, stop
//! and removal; the pod's IP answers from the host network namespace.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};
use twig_cri::api::{ContainerState, PodSandboxState};
use twig_cri::{container_config, logs, Node, NodeOptions};

const HANDLER: &str = "runc";
const HTTP_PORT: u16 = 8080;

/// GETs `/` from `ip:port`, retrying until `within` passes.
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

/// The IPs host-local still has reserved in the harness's IPAM store.
fn reserved_ips(node: &Node) -> Vec<String> {
    let dir = node.dir().join("cni/ipam").join(node.net().network_name());
    std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.parse::<IpAddr>().is_ok())
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_with_three_containers_through_cri_with_runc() {
    let node = Node::start(&NodeOptions::default()).unwrap_or_else(|e| panic!("CRI harness: {e}"));
    let cri = node.client().await.unwrap_or_else(|e| panic!("{e}"));
    let version = cri.version().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(version.runtime_name, "containerd");

    // Three images, each with its own /msg, pulled through CRI.
    let mut images = Vec::new();
    for n in ["a", "b", "c"] {
        let msg = format!("hello from {n}\n");
        let image = node
            .push_image(
                &format!("app-{n}"),
                &[("/msg", msg.as_bytes())],
                &["/bin/sh"],
            )
            .unwrap_or_else(|e| panic!("{e}"));
        let image_ref = cri
            .pull_image(&image)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(image_ref.starts_with("sha256:"), "{image_ref}");
        images.push(image);
    }

    let pod = node
        .pod_config("lifecycle")
        .unwrap_or_else(|e| panic!("{e}"));
    let pod_id = cri
        .run_pod_sandbox(&pod, HANDLER)
        .await
        .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", node.containerd().log_text()));
    let ip = cri.pod_ip(&pod_id).await.unwrap_or_else(|e| panic!("{e}"));
    let IpAddr::V4(v4) = ip else {
        panic!("pod IP {ip} is not IPv4");
    };
    let gw = node.net().gateway().octets();
    assert_eq!(
        v4.octets()[..3],
        gw[..3],
        "pod IP {ip} outside {}",
        node.net().subnet()
    );
    assert_eq!(reserved_ips(&node), vec![ip.to_string()]);

    // Three containers: a web server, one that writes to its rootfs, one
    // that only prints.
    let web_cmd = format!(
        "cat /msg; mkdir -p /www && echo twig-web-ok > /www/index.html && exec httpd -f -p {HTTP_PORT} -h /www"
    );
    let specs = [
        ("web", &images[0], web_cmd),
        (
            "writer",
            &images[1],
            "cat /msg; echo b-was-here > /own; exec sleep 3600".to_string(),
        ),
        (
            "printer",
            &images[2],
            "cat /msg; exec sleep 3600".to_string(),
        ),
    ];
    let mut ids = Vec::new();
    for (name, image, cmd) in &specs {
        let log_path = format!("{name}.log");
        let config = container_config(name, image, &["/bin/sh", "-c", cmd], &log_path);
        let id = cri
            .create_container(&pod_id, &config, &pod)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let status = cri
            .container_status(&id)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(status.state(), ContainerState::ContainerCreated);
        ids.push(id);
    }
    for id in &ids {
        cri.start_container(id)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }
    for ((name, _, _), n) in specs.iter().zip(["a", "b", "c"]) {
        let path = Node::container_log(&pod, &format!("{name}.log"));
        let want = format!("hello from {n}");
        let lines = logs::wait_for(&path, Duration::from_secs(30), |l| {
            l.iter().any(|l| l.text == want)
        })
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(lines[0].stream, "stdout");
    }
    let (web, writer, printer) = (&ids[0], &ids[1], &ids[2]);

    // ExecSync: output and exit code; each container sees its own rootfs.
    let out = cri
        .exec_sync(
            printer,
            &[
                "/bin/sh",
                "-c",
                "cat /msg; test -e /own && echo shared; echo oops >&2; exit 7",
            ],
            Duration::from_secs(30),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hello from c\n");
    assert_eq!(String::from_utf8_lossy(&out.stderr), "oops\n");
    assert_eq!(out.exit_code, 7);
    let out = cri
        .exec_sync(writer, &["cat", "/own"], Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        (String::from_utf8_lossy(&out.stdout).as_ref(), out.exit_code),
        ("b-was-here\n", 0)
    );

    // The pod's IP answers from the host network namespace.
    let body = http_get(ip, Duration::from_secs(30)).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        body.starts_with("HTTP/1.") && body.contains("twig-web-ok"),
        "{body}"
    );

    // ContainerStats: the writer's own id, memory and CPU in use.
    let stats = cri
        .container_stats(writer)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        stats.attributes.as_ref().map(|a| a.id.as_str()),
        Some(writer.as_str())
    );
    let mem = stats
        .memory
        .and_then(|m| m.working_set_bytes)
        .map(|v| v.value);
    assert!(mem.is_some_and(|b| b > 0), "working set {mem:?}");
    let cpu = stats
        .cpu
        .and_then(|c| c.usage_core_nano_seconds)
        .map(|v| v.value);
    assert!(cpu.is_some_and(|n| n > 0), "cpu {cpu:?}");

    // StopContainer: only that container exits.
    cri.stop_container(writer, Duration::from_secs(2))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let status = cri
        .container_status(writer)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(status.state(), ContainerState::ContainerExited);
    for id in [web, printer] {
        let status = cri
            .container_status(id)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            status.state(),
            ContainerState::ContainerRunning,
            "{}",
            status.id
        );
    }

    // StopPodSandbox: every container exits, the pod is not ready and its
    // IP stops answering.
    cri.stop_pod_sandbox(&pod_id)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let status = cri
        .pod_sandbox_status(&pod_id)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(status.state(), PodSandboxState::SandboxNotready);
    for id in &ids {
        let status = cri
            .container_status(id)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            status.state(),
            ContainerState::ContainerExited,
            "{}",
            status.id
        );
    }
    assert!(
        http_get(ip, Duration::from_millis(500)).is_err(),
        "{ip} still answers"
    );
    assert!(
        reserved_ips(&node).is_empty(),
        "CNI kept {:?}",
        reserved_ips(&node)
    );

    // RemovePodSandbox: pod and containers are gone.
    cri.remove_pod_sandbox(&pod_id)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
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
        .unwrap_or_else(|e| panic!("{e}"))
        .is_empty());
}
