//! Failure paths through the CRI plugin: each fails with an error that
//! names the culprit, and the node keeps working afterwards.

use std::time::Duration;
use twig_cri::api::ContainerState;
use twig_cri::{container_config, Node, NodeOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_image_and_unknown_handler_are_clear_errors() {
    let node = Node::start(&NodeOptions::default()).unwrap_or_else(|e| panic!("CRI harness: {e}"));
    let cri = node.client().await.unwrap_or_else(|e| panic!("{e}"));

    // An image the registry does not have.
    let missing = format!("{}/twig/does-not-exist:v1", node.registry().host());
    let err = cri.pull_image(&missing).await.err().map(|e| e.to_string());
    let err = err.unwrap_or_else(|| panic!("pulling {missing} succeeded"));
    assert!(
        err.contains("PullImage") && err.contains("does-not-exist"),
        "{err}"
    );

    // A container on an image that was never pulled.
    let pod = node
        .pod_config("failures")
        .unwrap_or_else(|e| panic!("{e}"));
    let pod_id = cri
        .run_pod_sandbox(&pod, "runc")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let config = container_config("ghost", &missing, &[], "ghost.log");
    let err = cri
        .create_container(&pod_id, &config, &pod)
        .await
        .err()
        .map(|e| e.to_string());
    let err = err.unwrap_or_else(|| panic!("a container on {missing} was created"));
    assert!(
        err.contains("CreateContainer") && err.contains("does-not-exist"),
        "{err}"
    );

    // A runtime handler containerd was not configured with.
    let other = node
        .pod_config("no-handler")
        .unwrap_or_else(|e| panic!("{e}"));
    let err = cri
        .run_pod_sandbox(&other, "no-such-handler")
        .await
        .err()
        .map(|e| e.to_string());
    let err = err.unwrap_or_else(|| panic!("a pod with handler no-such-handler started"));
    assert!(
        err.contains("RunPodSandbox") && err.contains("no-such-handler"),
        "{err}"
    );

    // Nothing was lost: the pod that did start still runs containers.
    let image = node.busybox_image().to_string();
    cri.pull_image(&image)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let config = container_config(
        "ok",
        &image,
        &["/bin/sh", "-c", "exec sleep 3600"],
        "ok.log",
    );
    let id = cri
        .create_container(&pod_id, &config, &pod)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    cri.start_container(&id)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let out = cri
        .exec_sync(&id, &["echo", "alive"], Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        (String::from_utf8_lossy(&out.stdout).as_ref(), out.exit_code),
        ("alive\n", 0)
    );
    let pods = cri
        .list_pod_sandboxes()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        pods.iter().map(|p| p.id.as_str()).collect::<Vec<_>>(),
        vec![pod_id.as_str()]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_that_does_not_exist_shows_in_the_container_status() {
    let node = Node::start(&NodeOptions::default()).unwrap_or_else(|e| panic!("CRI harness: {e}"));
    let cri = node.client().await.unwrap_or_else(|e| panic!("{e}"));
    let image = node.busybox_image().to_string();
    cri.pull_image(&image)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let pod = node
        .pod_config("bad-command")
        .unwrap_or_else(|e| panic!("{e}"));
    let pod_id = cri
        .run_pod_sandbox(&pod, "runc")
        .await
        .unwrap_or_else(|e| panic!("{e}"));

    let config = container_config("bad", &image, &["/no/such/binary"], "bad.log");
    let id = cri
        .create_container(&pod_id, &config, &pod)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let err = cri.start_container(&id).await.err().map(|e| e.to_string());
    let err = err.unwrap_or_else(|| panic!("starting /no/such/binary succeeded"));
    assert!(
        err.contains("StartContainer") && err.contains("/no/such/binary"),
        "{err}"
    );

    let status = cri
        .container_status(&id)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        status.state(),
        ContainerState::ContainerExited,
        "{status:?}"
    );
    assert_ne!(status.exit_code, 0, "{status:?}");
    assert_eq!(status.reason, "StartError", "{status:?}");
    assert!(status.message.contains("/no/such/binary"), "{status:?}");

    // The sandbox survives its container's failure.
    let ip = cri.pod_ip(&pod_id).await.unwrap_or_else(|e| panic!("{e}"));
    assert!(ip.is_ipv4(), "{ip}");
}

#[tokio::test]
async fn connecting_where_nothing_listens_names_the_socket() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let socket = dir.path().join("no-containerd.sock");
    let err = twig_cri::CriClient::connect(&socket)
        .await
        .err()
        .map(|e| e.to_string());
    let err = err.unwrap_or_else(|| panic!("connected to {}", socket.display()));
    assert!(
        err.contains(&socket.display().to_string()) && err.contains("No such file"),
        "{err}"
    );
}
