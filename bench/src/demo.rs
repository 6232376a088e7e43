//! The real path, end to end, as a user meets it (README's set-up-and-run
//! command: `tests/lab/run.sh --demo`). On a node of containerd with its
//! CRI plugin, twig-snapshotter, twig-node and the twig shim (twig-e2e's
//! `CriNode`, in the nested lab), driven as kubelet and the controller drive
//! them:
//!
//! 1. a pod of runtime handler `twig` (its VM restored from the node's base
//!    template, taken from the warm pool) runs an "agent" that writes its
//!    plan to its rootfs and counts in memory — next to the same pod on
//!    `runc`, the alternative a user would pick;
//! 2. `exec` into it (ExecSync): its own kernel, its plan;
//! 3. a snapshot of the running pod (memory, processes, disk) through the
//!    shim's `Twig` service, found and called with the controller's own
//!    `ContainerdLocator` and `TtrpcShim`;
//! 4. the agent's mistake — its plan deleted — undone by a rollback: the
//!    plan is back and the counter went back in time;
//! 5. a clone: a new pod annotated `twig.dev/restore-from`, whose container
//!    of the same name is adopted, still running, with the source's memory
//!    and files, under its own hostname.
//!
//! Every step is timed; the table goes to stderr and the JSON to stdout.

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use serde_json::{json, Value};
use twig_controller::crd::SnapshotMode;
use twig_controller::sandbox::{ContainerdLocator, SandboxLocator};
use twig_controller::shim::{Sandbox, TtrpcShim, TwigShim};
use twig_cri::{api, container_config, logs, CriClient};
use twig_e2e::cri::{CriNode, CALL, CRI_NAMESPACE};

use twig_proto::contract::RESTORE_FROM_ANNOTATION as RESTORE_FROM;

use crate::stats::{Context, Error, Report};

/// How long a step may take in the lab (TCG is slow).
const DEADLINE: Duration = Duration::from_secs(120);
/// The agent: writes its plan to its rootfs, then counts in memory
/// (`/dev/shm`) every 100 ms.
const AGENT: &str = "mkdir -p /notes && echo 'plan: try the careful way' > /notes/plan.txt && \
     echo ready; i=0; while :; do i=$((i+1)); echo $i > /dev/shm/n.new; \
     mv /dev/shm/n.new /dev/shm/n; sleep 0.1; done";

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: &Args) -> Result<Value, Error> {
    let t = Instant::now();
    let node = CriNode::start()
        .context(|| "starting the node (containerd + CRI, twig-snapshotter, twig-node)".into())?;
    let node_up = t.elapsed();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context(|| "tokio runtime".into())?;
    let mut demo = Demo {
        node: &node,
        report: Report::default(),
        pods: Vec::new(),
    };
    demo.step(
        "node_up_ms",
        node_up,
        "containerd, twig-snapshotter, twig-node (template ready)",
    );
    let result = rt.block_on(demo.scenario());
    let teardown = rt.block_on(demo.teardown());
    result?;
    teardown?;
    Ok(demo.report.into_value())
}

struct Demo<'a> {
    node: &'a CriNode,
    report: Report,
    /// Pods to stop and remove at the end.
    pods: Vec<String>,
}

/// A started pod: its one container, its config, its IP (CRI's).
struct Started {
    container_id: String,
    config: api::PodSandboxConfig,
    ip: String,
}

impl Demo<'_> {
    fn step(&mut self, key: &str, took: Duration, what: &str) {
        let ms = took.as_secs_f64() * 1e3;
        eprintln!("demo: {ms:>9.1} ms  {what}");
        self.report.insert(key, json!(ms));
    }

    async fn scenario(&mut self) -> Result<(), Error> {
        let cri = self.node.client().await?;

        // 0. Untimed: the first twig pod of a node builds its base template
        // (a guest boot) and both runtimes unpack the image once.
        let t = Instant::now();
        for handler in ["runc", "twig"] {
            self.start(&cri, &format!("warm-up-{handler}"), handler, None)
                .await?;
        }
        self.step(
            "warm_up_ms",
            t.elapsed(),
            "warm-up (untimed below): the node's base template built, the image unpacked",
        );

        // 1. The agent's pod, on twig and on runc.
        let t = Instant::now();
        self.start(&cri, "agent-runc", "runc", None).await?;
        self.step(
            "runc_pod_start_ms",
            t.elapsed(),
            "runc pod: RunPodSandbox + CreateContainer + StartContainer → first output",
        );
        let t = Instant::now();
        let pod = self.start(&cri, "agent", "twig", None).await?;
        self.step(
            "twig_pod_start_ms",
            t.elapsed(),
            "twig pod (VM restored from the template): the same → first output",
        );

        // 2. exec into it.
        let t = Instant::now();
        let out = exec(
            &cri,
            &pod.container_id,
            "uname -r; hostname; cat /notes/plan.txt",
        )
        .await?;
        self.step(
            "exec_ms",
            t.elapsed(),
            "ExecSync: uname -r; hostname; cat /notes/plan.txt",
        );
        eprintln!("{}", indent(&out));
        let source_hostname = out.lines().nth(1).unwrap_or_default().to_string();
        let source_ip = guest_ip(&cri, &pod.container_id).await?;
        eprintln!(
            "    the pod's IP (CRI): {} · the guest's eth0: {source_ip}",
            pod.ip
        );
        if source_ip != pod.ip {
            return Err(format!("the guest has {source_ip}, the pod is {}", pod.ip).into());
        }

        // 3. Snapshot, through the controller's locator and client.
        let locator = ContainerdLocator::new(
            self.node
                .node()
                .dir()?
                .join("containerd/state/io.containerd.runtime.v2.task")
                .join(CRI_NAMESPACE),
        );
        let uid = pod
            .config
            .metadata
            .as_ref()
            .map(|m| m.uid.clone())
            .unwrap_or_default();
        let mut k8s_pod = Pod::default();
        k8s_pod.metadata.uid = Some(uid);
        let sandbox: Sandbox = locator
            .locate(&k8s_pod)
            .await
            .context(|| "ContainerdLocator: the pod's shim".into())?;
        let shim = TtrpcShim { timeout: CALL };
        let snapshot_id = format!("demo-{}", std::process::id());
        // A mark only the snapshot's memory holds.
        let mark = format!("made before snapshot {snapshot_id}");
        exec(
            &cri,
            &pod.container_id,
            &format!("echo '{mark}' > /dev/shm/mark"),
        )
        .await?;
        let before = counter(&cri, &pod.container_id).await?;
        let t = Instant::now();
        let info = shim
            .snapshot(&sandbox, &snapshot_id, SnapshotMode::Full)
            .await
            .context(|| "Snapshot".into())?;
        self.step(
            "snapshot_ms",
            t.elapsed(),
            "Snapshot (full: memory, vCPUs, devices, the container's disk)",
        );
        eprintln!(
            "    {} · {} MiB in the node store · counter ≈ {before}",
            info.snapshot_id,
            info.size_bytes >> 20
        );

        // 4. The mistake, and the rollback.
        exec(&cri, &pod.container_id, "rm -rf /notes && sync").await?;
        let gone = exec(&cri, &pod.container_id, "cat /notes/plan.txt 2>&1 || true").await?;
        eprintln!("    the agent's mistake: rm -rf /notes → {}", gone.trim());
        let at_mistake = counter(&cri, &pod.container_id).await?;
        let t = Instant::now();
        shim.rollback(&sandbox, &snapshot_id, "demo-rollback-1")
            .await
            .context(|| "Rollback".into())?;
        self.step(
            "rollback_ms",
            t.elapsed(),
            "Rollback in place (memory, processes, disk)",
        );
        let plan = exec(&cri, &pod.container_id, "cat /notes/plan.txt").await?;
        let after = counter(&cri, &pod.container_id).await?;
        eprintln!(
            "    after: {} · counter {at_mistake} → {after} (snapshot ≈ {before})",
            plan.trim()
        );
        if !plan.contains("careful") || after >= at_mistake {
            return Err(format!(
                "after the rollback the plan reads {plan:?} and the counter {after} \
                 (it was {at_mistake})"
            )
            .into());
        }

        // 5. A clone from the snapshot.
        let t = Instant::now();
        let clone = self
            .start(&cri, "agent-clone", "twig", Some(&snapshot_id))
            .await?;
        let out = exec(
            &cri,
            &clone.container_id,
            "hostname; cat /notes/plan.txt; cat /dev/shm/mark; cat /dev/shm/n",
        )
        .await?;
        self.step(
            "clone_ms",
            t.elapsed(),
            "Clone: a pod restored from the snapshot, its container adopted, exec answered",
        );
        eprintln!("{}", indent(&out));
        let clone_ip = guest_ip(&cri, &clone.container_id).await?;
        eprintln!(
            "    the clone's IP (CRI): {} · its guest's eth0: {clone_ip} (the source's: {})",
            clone.ip, pod.ip
        );
        let mut lines = out.lines();
        let hostname = lines.next().unwrap_or_default();
        if hostname == source_hostname
            || !out.contains("careful")
            || !out.contains(&mark)
            || clone_ip != clone.ip
            || clone_ip == pod.ip
        {
            return Err(format!(
                "the clone answered {out:?} at {clone_ip} (source hostname \
                 {source_hostname:?}, IP {}; clone's IP {})",
                pod.ip, clone.ip
            )
            .into());
        }
        self.report.value("snapshot_id", json!(snapshot_id));
        Ok(())
    }

    /// RunPodSandbox + CreateContainer + StartContainer of the agent, until
    /// its first output; a clone (`restore_from`) prints nothing new, so it
    /// is started and not awaited.
    async fn start(
        &mut self,
        cri: &CriClient,
        name: &str,
        handler: &str,
        restore_from: Option<&str>,
    ) -> Result<Started, Error> {
        let mut config = self.node.pod_config(name)?;
        if let Some(id) = restore_from {
            config.annotations.insert(RESTORE_FROM.into(), id.into());
        }
        let pod_id = cri
            .run_pod_sandbox(&config, handler)
            .await
            .map_err(|e| self.node.cri_error(&format!("RunPodSandbox {name}"), e))?;
        self.pods.push(pod_id.clone());
        let container = container_config(
            "agent",
            twig_e2e::IMAGE_REF,
            &["/bin/sh", "-c", AGENT],
            "agent.log",
        );
        let container_id = cri
            .create_container(&pod_id, &container, &config)
            .await
            .map_err(|e| {
                self.node
                    .cri_error(&format!("CreateContainer in {name}"), e)
            })?;
        cri.start_container(&container_id)
            .await
            .map_err(|e| self.node.cri_error(&format!("StartContainer in {name}"), e))?;
        if restore_from.is_none() {
            let log = CriNode::container_log(&config, "agent.log");
            logs::wait_for(&log, DEADLINE, |lines| {
                lines.iter().any(|l| l.text == "ready")
            })
            .await
            .context(|| format!("the first output of {name}"))?;
        }
        let ip = cri
            .pod_ip(&pod_id)
            .await
            .map_err(|e| self.node.cri_error(&format!("the IP of {name}"), e))?
            .to_string();
        Ok(Started {
            container_id,
            config,
            ip,
        })
    }

    async fn teardown(&mut self) -> Result<(), Error> {
        let cri = self.node.client().await?;
        let t = Instant::now();
        for id in std::mem::take(&mut self.pods) {
            cri.stop_pod_sandbox(&id)
                .await
                .map_err(|e| self.node.cri_error("StopPodSandbox", e))?;
            cri.remove_pod_sandbox(&id)
                .await
                .map_err(|e| self.node.cri_error("RemovePodSandbox", e))?;
        }
        self.step(
            "teardown_ms",
            t.elapsed(),
            "StopPodSandbox + RemovePodSandbox of every pod",
        );
        Ok(())
    }
}

/// ExecSync of `script` in `container`; a non-zero exit is an error.
async fn exec(cri: &CriClient, container: &str, script: &str) -> Result<String, Error> {
    let out = cri
        .exec_sync(container, &["/bin/sh", "-c", script], DEADLINE)
        .await
        .context(|| format!("ExecSync {script:?}"))?;
    if out.exit_code != 0 {
        return Err(format!(
            "ExecSync {script:?} exited {}: {}",
            out.exit_code,
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The agent's in-memory counter.
async fn counter(cri: &CriClient, container: &str) -> Result<u64, Error> {
    let out = exec(cri, container, "cat /dev/shm/n").await?;
    out.trim()
        .parse()
        .context(|| format!("the counter reads {out:?}"))
}

/// The IPv4 address of the guest's `eth0`, as `container` sees it.
async fn guest_ip(cri: &CriClient, container: &str) -> Result<String, Error> {
    let out = exec(cri, container, "ip -4 -o addr show eth0").await?;
    out.split_whitespace()
        .skip_while(|w| *w != "inet")
        .nth(1)
        .and_then(|cidr| cidr.split('/').next())
        .map(str::to_string)
        .ok_or_else(|| format!("no IPv4 address on eth0: {out:?}").into())
}

fn indent(text: &str) -> String {
    text.lines()
        .map(|l| format!("    | {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}
