//! The pod's resources choose its VM's shape, through containerd's CRI
//! plugin as kubelet drives it: the pod's limits go in
//! `PodSandboxConfig.linux.resources` (what kubelet puts there: the sum of
//! its containers' limits), containerd 1.6 passes them to the shim as the
//! sandbox annotations `io.kubernetes.cri.sandbox-memory` /
//! `-cpu-quota` / `-cpu-period`, and twig-node gives the pod the smallest
//! of its base template shapes that holds them (the lab node's: its
//! 128 MiB × 1 default and twig-node's default larger shapes, 512 MiB × 2
//! the smallest). A pod without limits gets the default shape; a pod
//! asking more than any shape is refused, clearly, and takes no VM. Built
//! with `--features lab` and run in the nested lab by `tests/lab/run.sh
//! -p twig-e2e --features twig-e2e/lab --test shapes`.

use std::time::Duration;

use twig_cri::api;
use twig_cri::container_config;
use twig_e2e::cri::CriNode;
use twig_e2e::{BASE_MEM_MIB, IMAGE_REF};

/// ExecSync's own limit.
const EXEC: Duration = Duration::from_secs(120);
/// How long a removed pod's shim and VMM may take to go.
const GONE: Duration = Duration::from_secs(60);
const MIB: i64 = 1 << 20;

/// A pod's resources as kubelet computes them for one container with
/// these limits (CFS period 100 ms).
fn limits(memory_mib: i64, cpu_millis: i64) -> api::LinuxContainerResources {
    api::LinuxContainerResources {
        memory_limit_in_bytes: memory_mib * MIB,
        cpu_period: 100_000,
        cpu_quota: cpu_millis * 100,
        cpu_shares: 1024,
        ..Default::default()
    }
}

/// `(MemTotal, MemAvailable)` in KiB from a guest's `/proc/meminfo`.
fn meminfo(text: &str) -> (u64, u64) {
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {text:?}"))
    };
    (field("MemTotal:"), field("MemAvailable:"))
}

async fn scenario() {
    let node = CriNode::start().unwrap_or_else(|e| panic!("CRI node: {e}"));
    let cri = node.client().await.unwrap_or_else(|e| panic!("{e}"));
    let fail = |what: &str, e: twig_cri::Error| -> ! { panic!("{}", node.cri_error(what, e)) };
    let node_log = node
        .node()
        .dir()
        .unwrap_or_else(|e| panic!("{e}"))
        .join("twig-node.log");
    let handed = || {
        std::fs::read_to_string(&node_log)
            .unwrap_or_default()
            .matches("handed over a VMM")
            .count()
    };

    // (pod name, its limits, the VM's RAM in MiB and vCPUs)
    for (name, resources, mem_mib, vcpus) in [
        ("unlimited", None, BASE_MEM_MIB, 1),
        ("sized", Some(limits(300, 1500)), 512, 2),
    ] {
        let mut pod = node.pod_config(name).unwrap_or_else(|e| panic!("{e}"));
        if let Some(linux) = pod.linux.as_mut() {
            linux.resources = resources;
        }
        let pod_id = cri
            .run_pod_sandbox(&pod, "twig")
            .await
            .unwrap_or_else(|e| fail(&format!("RunPodSandbox {name}"), e));
        let config = container_config(
            "app",
            IMAGE_REF,
            &["/bin/sh", "-c", "while :; do sleep 1; done"],
            "app.log",
        );
        let id = cri
            .create_container(&pod_id, &config, &pod)
            .await
            .unwrap_or_else(|e| fail("CreateContainer", e));
        cri.start_container(&id)
            .await
            .unwrap_or_else(|e| fail("StartContainer", e));
        let out = cri
            .exec_sync(&id, &["cat", "/proc/meminfo"], EXEC)
            .await
            .unwrap_or_else(|e| fail("ExecSync meminfo", e));
        let (total, available) = meminfo(&String::from_utf8_lossy(&out.stdout));
        let out = cri
            .exec_sync(&id, &["nproc"], EXEC)
            .await
            .unwrap_or_else(|e| fail("ExecSync nproc", e));
        let nproc = String::from_utf8_lossy(&out.stdout).trim().to_string();
        eprintln!(
            "pod {name}: a {mem_mib} MiB × {vcpus} VM: MemTotal {total} kB, MemAvailable \
             {available} kB ({} MiB of RAM not available to the pod), nproc {nproc}",
            (mem_mib * 1024 - available) / 1024
        );
        // The guest kernel keeps a few MiB of RAM for itself: MemTotal is
        // a little under the VM's RAM, and more than the next smaller
        // shape's.
        let ram_kib = mem_mib * 1024;
        assert!(
            total <= ram_kib && total > ram_kib * 3 / 4,
            "pod {name}: MemTotal {total} kB in a VM of {mem_mib} MiB\n{}",
            node.node().logs()
        );
        assert_eq!(nproc, vcpus.to_string(), "pod {name}: nproc");
        cri.stop_pod_sandbox(&pod_id)
            .await
            .unwrap_or_else(|e| fail("StopPodSandbox", e));
        cri.remove_pod_sandbox(&pod_id)
            .await
            .unwrap_or_else(|e| fail("RemovePodSandbox", e));
    }

    // More than any shape (the largest is 2048 MiB × 4): refused before a
    // VM is taken, and nothing is left.
    let before = handed();
    let mut pod = node.pod_config("huge").unwrap_or_else(|e| panic!("{e}"));
    if let Some(linux) = pod.linux.as_mut() {
        linux.resources = Some(limits(4096, 500));
    }
    let e = cri
        .run_pod_sandbox(&pod, "twig")
        .await
        .err()
        .unwrap_or_else(|| panic!("a pod asking 4 GiB started\n{}", node.node().logs()));
    let msg = e.to_string();
    for needle in [
        "the pod asks for a memory limit of 4096 MiB",
        "more than any VM shape of this node holds (the largest: 2048 MiB × 4 vCPUs",
    ] {
        assert!(msg.contains(needle), "{msg}\nwanted: {needle}");
    }
    assert_eq!(handed(), before, "a VM was handed over for the refused pod");
    node.expect_nothing_left(&[], GONE, "the refused RunPodSandbox")
        .await;
}

#[test]
fn the_pods_limits_choose_its_vm_shape() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("a tokio runtime: {e}"));
    rt.block_on(scenario());
}
