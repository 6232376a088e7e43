//! A container killed by its memory limit, seen through CRI as kubelet
//! sees it: `ContainerStatus` says exited, 137, reason `OOMKilled` (the
//! CRI plugin's reading of the shim's TaskOOM event), with twig's runtime
//! and, as the reference, with runc's. Built with `--features lab` and run
//! in the nested lab by `tests/lab/run.sh -p twig-e2e --features
//! twig-e2e/lab`.

use std::time::Duration;

use twig_cri::api;
use twig_cri::container_config;
use twig_e2e::cri::CriNode;
use twig_e2e::crilab::{runtime, wait_exited};
use twig_e2e::IMAGE_REF;

/// How long the container may take to reach its limit and die (TCG).
const DEADLINE: Duration = Duration::from_secs(180);
const LIMIT: i64 = 64 << 20;

fn oom_killed(handler: &str) {
    runtime().block_on(scenario(handler));
}

async fn scenario(handler: &str) {
    let node = CriNode::start().unwrap_or_else(|e| panic!("CRI node: {e}"));
    let cri = node.client().await.unwrap_or_else(|e| panic!("{e}"));
    let fail = |what: &str, e: twig_cri::Error| -> ! { panic!("{}", node.cri_error(what, e)) };
    let pod = node.pod_config("oom").unwrap_or_else(|e| panic!("{e}"));
    let pod_id = cri
        .run_pod_sandbox(&pod, handler)
        .await
        .unwrap_or_else(|e| fail("RunPodSandbox", e));
    // The shell itself grows a string until the limit kills it (a
    // user-space fault: the cgroup's OOM killer, not a failed syscall).
    let mut config = container_config(
        "hog",
        IMAGE_REF,
        &["/bin/sh", "-c", "echo start; x=a; while :; do x=$x$x; done"],
        "hog.log",
    );
    config.linux = Some(api::LinuxContainerConfig {
        resources: Some(api::LinuxContainerResources {
            memory_limit_in_bytes: LIMIT,
            ..Default::default()
        }),
        ..Default::default()
    });
    let id = cri
        .create_container(&pod_id, &config, &pod)
        .await
        .unwrap_or_else(|e| fail("CreateContainer", e));
    cri.start_container(&id)
        .await
        .unwrap_or_else(|e| fail("StartContainer", e));
    let status = wait_exited(&node, &cri, &id, DEADLINE).await;
    assert_eq!(
        (status.exit_code, status.reason.as_str()),
        (137, "OOMKilled"),
        "{status:?}\n{}",
        node.node().logs()
    );
    cri.stop_pod_sandbox(&pod_id)
        .await
        .unwrap_or_else(|e| fail("StopPodSandbox", e));
    cri.remove_pod_sandbox(&pod_id)
        .await
        .unwrap_or_else(|e| fail("RemovePodSandbox", e));
}

#[test]
fn twig_reports_an_oom_killed_container_to_cri() {
    oom_killed("twig");
}

#[test]
fn runc_reports_an_oom_killed_container_to_cri() {
    oom_killed("runc");
}
