//! A pod's security context, as kubelet passes it through CRI, holds
//! inside the microVM as it does under runc: `runAsUser`/`runAsGroup`,
//! capabilities dropped (no `chown`, no port 80), the `RuntimeDefault`
//! seccomp profile (`unshare` and `keyctl` refused with EPERM by the filter:
//! without it the guest's kernel answers EINVAL and ENOSYS, having neither
//! user namespaces nor keys), and a read-only root file system. The
//! containers run the lab's Python image (busybox and python3.11), so a
//! raw `keyctl` can be made through ctypes. Each check runs
//! through `ExecSync` in a container that has the context (an exec gets
//! its container's user, capabilities and filter), with twig's runtime
//! and, as the reference, with runc's. Built with `--features lab` and
//! run in the nested lab by `tests/lab/run.sh -p twig-e2e --features
//! twig-e2e/lab`.

use std::time::Duration;

use twig_cri::api::{self, security_profile::ProfileType};
use twig_cri::container_config;
use twig_e2e::cri::CriNode;
use twig_e2e::crilab::runtime;

/// The lab's Python image (tests/lab/run.sh: `TWIG_E2E_PYTHON_IMAGE`).
const PYTHON_REF: &str = "docker.io/library/twig-e2e-python:v1";
/// `keyctl(KEYCTL_GET_KEYRING_ID, 0)` through libc's `syscall`: prints
/// `keyctl <result> <errno>`.
const KEYCTL: &str =
    "/usr/bin/python3.11 -c 'import ctypes; c = ctypes.CDLL(None, use_errno=True); \
     r = c.syscall(250, 0, 0); print(\"keyctl\", r, ctypes.get_errno())'";

/// Deadline of one check (TCG).
const EXEC: Duration = Duration::from_secs(60);

/// One container of the pod and its security context.
fn container(name: &str, security: api::LinuxContainerSecurityContext) -> api::ContainerConfig {
    let mut config = container_config(
        name,
        PYTHON_REF,
        &["/bin/sleep", "100000"],
        &format!("{name}.log"),
    );
    config.linux = Some(api::LinuxContainerConfig {
        security_context: Some(security),
        ..Default::default()
    });
    config
}

fn secure(handler: &str) {
    runtime().block_on(scenario(handler));
}

async fn scenario(handler: &str) {
    let node = CriNode::start().unwrap_or_else(|e| panic!("CRI node: {e}"));
    let image = std::env::var_os("TWIG_E2E_PYTHON_IMAGE").unwrap_or_else(|| {
        panic!("TWIG_E2E_PYTHON_IMAGE is not set: run this test through tests/lab/run.sh")
    });
    node.import_image(std::path::Path::new(&image))
        .unwrap_or_else(|e| panic!("importing the Python image: {e}"));
    let cri = node.client().await.unwrap_or_else(|e| panic!("{e}"));
    let fail = |what: &str, e: twig_cri::Error| -> ! { panic!("{}", node.cri_error(what, e)) };
    let pod = node.pod_config("secctx").unwrap_or_else(|e| panic!("{e}"));
    let pod_id = cri
        .run_pod_sandbox(&pod, handler)
        .await
        .unwrap_or_else(|e| fail("RunPodSandbox", e));
    let containers = [
        container(
            "user",
            api::LinuxContainerSecurityContext {
                run_as_user: Some(api::Int64Value { value: 1000 }),
                run_as_group: Some(api::Int64Value { value: 1001 }),
                ..Default::default()
            },
        ),
        container(
            "nocaps",
            api::LinuxContainerSecurityContext {
                capabilities: Some(api::Capability {
                    drop_capabilities: vec!["ALL".into()],
                    ..Default::default()
                }),
                ..Default::default()
            },
        ),
        container(
            "seccomp",
            api::LinuxContainerSecurityContext {
                seccomp: Some(api::SecurityProfile {
                    profile_type: ProfileType::RuntimeDefault as i32,
                    ..Default::default()
                }),
                ..Default::default()
            },
        ),
        container(
            "readonly",
            api::LinuxContainerSecurityContext {
                readonly_rootfs: true,
                ..Default::default()
            },
        ),
    ];
    let mut ids = Vec::new();
    for config in &containers {
        let id = cri
            .create_container(&pod_id, config, &pod)
            .await
            .unwrap_or_else(|e| fail("CreateContainer", e));
        cri.start_container(&id)
            .await
            .unwrap_or_else(|e| fail("StartContainer", e));
        ids.push(id);
    }
    let run = |i: usize, script: String| {
        let (cri, id) = (&cri, ids[i].clone());
        async move {
            let out = cri
                .exec_sync(&id, &["/bin/sh", "-c", &script], EXEC)
                .await
                .unwrap_or_else(|e| fail("ExecSync", e));
            format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )
        }
    };

    let out = run(0, "echo uid=$(id -u) gid=$(id -g)".to_string()).await;
    assert_eq!(
        out.trim(),
        "uid=1000 gid=1001",
        "{handler}: runAsUser/runAsGroup"
    );

    let out = run(
        1,
        "grep CapEff /proc/self/status; chown 1 /etc/passwd 2>/dev/null; echo chown=$?; \
         timeout 5 nc -l -p 80 2>/dev/null; echo bind=$?"
            .to_string(),
    )
    .await;
    assert!(
        out.contains("CapEff:\t0000000000000000") && out.contains("chown=1"),
        "{handler}: all capabilities dropped: {out}"
    );
    assert!(
        out.contains("bind=1"),
        "{handler}: port 80 needs CAP_NET_BIND_SERVICE: {out}"
    );

    let out = run(
        2,
        "grep -E '^(Seccomp|NoNewPrivs):' /proc/self/status".to_string(),
    )
    .await;
    assert!(
        out.contains("Seccomp:\t2"),
        "{handler}: RuntimeDefault installs a filter: {out}"
    );
    let out = run(1, "grep '^Seccomp:' /proc/self/status".to_string()).await;
    assert!(
        out.contains("Seccomp:\t0"),
        "{handler}: without a profile there is no filter: {out}"
    );
    let blocked = format!("unshare -U true 2>&1; echo unshare=$?; {KEYCTL}");
    let out = run(2, blocked).await;
    assert!(
        out.contains("Operation not permitted") && out.contains("keyctl -1 1\n"),
        "{handler}: RuntimeDefault refuses unshare and keyctl with EPERM: {out}"
    );
    let out = run(1, KEYCTL.to_string()).await;
    assert!(
        out.contains("keyctl ") && !out.contains("keyctl -1 1\n"),
        "{handler}: without a filter keyctl is not refused with EPERM: {out}"
    );

    let out = run(3, "touch /written 2>&1; echo touch=$?".to_string()).await;
    assert!(
        out.contains("touch=1") && out.contains("Read-only file system"),
        "{handler}: readOnlyRootFilesystem: {out}"
    );
    let out = run(0, "touch /written-by-1000 2>&1; echo touch=$?".to_string()).await;
    assert!(
        out.contains("touch=1") && out.contains("Permission denied"),
        "{handler}: uid 1000 cannot write root's /: {out}"
    );

    cri.stop_pod_sandbox(&pod_id)
        .await
        .unwrap_or_else(|e| fail("StopPodSandbox", e));
    cri.remove_pod_sandbox(&pod_id)
        .await
        .unwrap_or_else(|e| fail("RemovePodSandbox", e));
}

#[test]
fn twig_holds_the_pods_security_context() {
    secure("twig");
}

#[test]
fn runc_holds_the_pods_security_context() {
    secure("runc");
}

/// `hostIPC`/`hostPID`/`hostNetwork`: CRI's `namespace_options` with the
/// node's mode. On twig RunPodSandbox fails naming the field (a VM cannot
/// share the node's IPC, PID or network namespace); runc, the reference,
/// honours them. A `hostNetwork` pod that asks for no network at all
/// (`twig.dev/network: none`) runs on both: on twig its VM has none.
fn host_namespaces(handler: &str) {
    runtime().block_on(async {
        let node = CriNode::start().unwrap_or_else(|e| panic!("CRI node: {e}"));
        let cri = node.client().await.unwrap_or_else(|e| panic!("{e}"));
        for (field, options) in [
            (
                "hostIPC",
                api::NamespaceOption {
                    ipc: api::NamespaceMode::Node as i32,
                    ..Default::default()
                },
            ),
            (
                "hostPID",
                api::NamespaceOption {
                    pid: api::NamespaceMode::Node as i32,
                    ..Default::default()
                },
            ),
            (
                "hostNetwork",
                api::NamespaceOption {
                    network: api::NamespaceMode::Node as i32,
                    ..Default::default()
                },
            ),
            (
                "offline",
                api::NamespaceOption {
                    network: api::NamespaceMode::Node as i32,
                    ..Default::default()
                },
            ),
        ] {
            let mut pod = node.pod_config("hostns").unwrap_or_else(|e| panic!("{e}"));
            if options.network == api::NamespaceMode::Node as i32 {
                // kubelet gives a pod on the node's network the node's
                // hostname: none of its own.
                pod.hostname = String::new();
            }
            if field == "offline" {
                pod.annotations.insert(
                    twig_proto::contract::NETWORK_ANNOTATION.into(),
                    twig_proto::contract::NETWORK_NONE.into(),
                );
            }
            let linux = pod.linux.get_or_insert_with(Default::default);
            linux
                .security_context
                .get_or_insert_with(Default::default)
                .namespace_options = Some(options);
            let ran = cri.run_pod_sandbox(&pod, handler).await;
            match (handler, ran) {
                ("twig", Err(e)) if field != "offline" => {
                    let text = e.to_string();
                    assert!(
                        text.contains(&format!("spec.{field}")) && text.contains("twig runtime"),
                        "{text}"
                    );
                }
                ("twig", Ok(id)) if field != "offline" => panic!("twig ran a {field} pod: {id}"),
                (_, Ok(id)) => {
                    cri.stop_pod_sandbox(&id)
                        .await
                        .unwrap_or_else(|e| panic!("{}", node.cri_error("StopPodSandbox", e)));
                    cri.remove_pod_sandbox(&id)
                        .await
                        .unwrap_or_else(|e| panic!("{}", node.cri_error("RemovePodSandbox", e)));
                }
                (_, Err(e)) => panic!("{}", node.cri_error(&format!("{field} on {handler}"), e)),
            }
        }
    });
}

#[test]
fn twig_refuses_the_nodes_ipc_pid_and_network_namespaces_naming_the_field() {
    host_namespaces("twig");
}

#[test]
fn runc_runs_pods_on_the_nodes_ipc_pid_and_network_namespaces() {
    host_namespaces("runc");
}
