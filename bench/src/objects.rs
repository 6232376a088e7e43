//! Twig's Kubernetes objects against their cost at the shim, in the nested
//! lab (`tests/lab/run.sh --bench objects`). On twig-e2e's [`CtrlLab`]
//! (containerd's CRI plugin, the twig shim, twig-node, the controller
//! reconciling in the testkit's API server, the test kubelet), with an
//! agent pod that counts in memory every 100 ms and, once it is gone, an
//! idle one to fork:
//!
//! - **Snapshot**: a Snapshot object created → `Ready` (seen by a watch),
//!   against the shim's `Snapshot` call on the same pod, rounds alternating;
//! - **Rollback**: a Rollback object (no safety snapshot, then with one, the
//!   default) created → `Ready` → the pod's container answers an exec,
//!   against the shim's `Rollback` call → the same exec;
//! - **Clone ×N**: a Clone of N replicas of a snapshot of the fork source
//!   (an agent waiting on its model) created → `Ready` (all N pods
//!   Ready, as the kubelet reports them; then what the N idle pods' VMs
//!   cost the node for 10 s), against what the kubelet does for
//!   N clone pods with no controller or API server: N RunPodSandbox +
//!   CreateContainer + StartContainer through CRI at once, annotated
//!   `twig.dev/restore-from` with the snapshot's node-store id.
//!
//! The difference is the controller's overhead: its reconcile, the API
//! server's round trips and the kubelet's watch. The pods are on the node's
//! network (no eBPF path: eBPF verification beside nested guests provokes
//! the lab's wedges, tests/lab/README.md), both ways.

use std::time::{Duration, Instant};

use futures::future::try_join_all;
use k8s_openapi::api::core::v1::{Container, Pod};
use kube::api::{DeleteParams, ListParams};
use kube::runtime::wait::await_condition;
use kube::{Api, Resource};
use serde_json::{json, Value};
use twig_controller::crd::{
    CloneSource, CloneSpec, DeletionPolicy, Phase, PodClone, Rollback, RollbackSpec, Snapshot,
    SnapshotMode, SnapshotSpec, CLONE_LABEL, RESTORE_FROM_ANNOTATION,
};
use twig_controller::sandbox::{ContainerdLocator, SandboxLocator};
use twig_controller::shim::{Sandbox, TtrpcShim, TwigShim};
use twig_controller_testkit::{self as testkit, NS};
use twig_cri::CriClient;
use twig_e2e::cost;
use twig_e2e::cri::{CALL, CRI_NAMESPACE};
use twig_e2e::ctrllab::{offline, twig_pod, CtrlLab};

use crate::stats::{Context, Error, Report, Summary};

/// How long one step may take in the lab, and the test kubelet's CRI
/// calls (64 guests restored under TCG, a few at a time: the shim's start
/// gate).
const DEADLINE: Duration = Duration::from_secs(1800);
/// The agent's container.
const CONTAINER: &str = "agent";
/// The agent: counts in memory (`/dev/shm`) every 100 ms.
const AGENT: &str = "i=0; while :; do i=$((i+1)); echo $i > /dev/shm/n.new; \
     mv /dev/shm/n.new /dev/shm/n; sleep 0.1; done";
/// The pod the Clones fork: an agent that wrote its state and now waits on
/// its model (blocked, as an agent waiting for an LLM's answer is). Its
/// clones run nothing until asked. (The busy agent above forks twice every
/// 100 ms, and even a shell counting once a second forks a `sleep` each
/// time: in 64 nested guests either alone saturates the lab's one emulated
/// CPU.)
const FORK_SOURCE: &str = "echo 1 > /dev/shm/n; exec sleep 2147483647";
/// How often a Clone's progress and the node's CPU are printed.
const WATCH_EVERY: Duration = Duration::from_secs(30);
/// How long the Clone's pods are watched once Ready, for what idle clones
/// cost the node.
const IDLE_WINDOW: Duration = Duration::from_secs(10);

#[derive(clap::Args)]
pub struct Args {
    /// Rounds of Snapshot and of each Rollback, each way.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// The Clones' fan-outs, each measured once each way.
    #[arg(long, value_delimiter = ',', default_value = "8,64")]
    replicas: Vec<usize>,
}

pub fn run(args: &Args) -> Result<Value, Error> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context(|| "tokio runtime".into())?;
    rt.block_on(bench(args))
}

async fn bench(args: &Args) -> Result<Value, Error> {
    let lab = CtrlLab::start_with("objects", &[], DEADLINE).await;
    let (pod, ctr) = start_pod(&lab, "agent", AGENT).await;
    let b = Bench {
        lab: &lab,
        ctr,
        sandbox: ContainerdLocator::new(
            lab.node
                .node()
                .dir()?
                .join("containerd/state/io.containerd.runtime.v2.task")
                .join(CRI_NAMESPACE),
        )
        .locate(&pod)
        .await
        .context(|| "ContainerdLocator: the agent pod's shim".into())?,
        shim: TtrpcShim { timeout: CALL },
    };
    // Its first count may still be ahead of it.
    let deadline = Instant::now() + DEADLINE;
    while let Err(e) = b.answers().await {
        if Instant::now() > deadline {
            return Err(e);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    lab.step("agent pod running");
    let mut report = Report::default();
    b.snapshots(args.rounds, &mut report).await?;
    b.rollbacks(args.rounds, &mut report).await?;
    if args.replicas.is_empty() {
        return Ok(report.into_value());
    }
    // The busy agent is measured; the Clones have the node to themselves
    // and their source.
    b.remove_agent().await?;
    start_pod(&lab, "fork-source", FORK_SOURCE).await;
    lab.step("fork source running");
    let source = b.object_snapshot("clone-source", "fork-source").await?;
    for &n in &args.replicas {
        b.clones(n, &source, &mut report).await?;
    }
    Ok(report.into_value())
}

/// Starts the pod `name` on the node's network, its container
/// [`CONTAINER`] running `script`: the pod and its container's CRI id.
async fn start_pod(lab: &CtrlLab, name: &str, script: &str) -> (Pod, String) {
    let mut pod = twig_pod(
        name,
        Container {
            name: CONTAINER.into(),
            image: Some(twig_e2e::IMAGE_REF.into()),
            command: Some(vec!["/bin/sh".into(), "-c".into(), script.into()]),
            ..Default::default()
        },
    );
    offline(&mut pod);
    testkit::create(&lab.client, &pod).await;
    lab.running(name, CONTAINER).await
}

struct Bench<'a> {
    lab: &'a CtrlLab,
    /// The agent pod's container (CRI id).
    ctr: String,
    /// The agent pod's shim, as the controller finds it.
    sandbox: Sandbox,
    shim: TtrpcShim,
}

impl Bench<'_> {
    fn cri(&self) -> &CriClient {
        &self.lab.cri
    }

    /// The agent's container answers an exec with its counter.
    async fn answers(&self) -> Result<u64, Error> {
        let out = self
            .cri()
            .exec_sync(&self.ctr, &["cat", "/dev/shm/n"], DEADLINE)
            .await
            .context(|| "exec in the agent".into())?;
        let text = String::from_utf8_lossy(&out.stdout);
        if out.exit_code != 0 {
            return Err(format!("exec in the agent exited {}: {text}", out.exit_code).into());
        }
        text.trim()
            .parse()
            .context(|| format!("the agent's counter reads {text:?}"))
    }

    /// A Snapshot object `name` of the pod `pod`, created and awaited: its
    /// node-store id.
    async fn object_snapshot(&self, name: &str, pod: &str) -> Result<String, Error> {
        let snapshot = Snapshot::new(
            name,
            SnapshotSpec {
                pod_name: pod.into(),
                pod_uid: None,
                mode: SnapshotMode::Incremental,
                deletion_policy: DeletionPolicy::Delete,
                ttl_seconds_after_ready: None,
                failure_deadline_seconds: None,
                export: false,
            },
        );
        testkit::create(&self.lab.client, &snapshot).await;
        let done = self
            .until_done(name, |s: &Snapshot| {
                s.status.as_ref().map(|s| (s.phase, s.message.clone()))
            })
            .await?;
        done.status
            .and_then(|s| s.snapshot_id)
            .ok_or_else(|| format!("Snapshot {name} is Ready without a snapshot id").into())
    }

    /// Waits (watching) until the object `name` is Ready or Failed; Failed
    /// is an error with its message.
    async fn until_done<K>(
        &self,
        name: &str,
        phase: impl Fn(&K) -> Option<(Phase, Option<String>)>,
    ) -> Result<K, Error>
    where
        K: Resource<DynamicType = (), Scope = kube::core::NamespaceResourceScope>
            + Clone
            + k8s_openapi::serde::de::DeserializeOwned
            + std::fmt::Debug
            + Send
            + 'static,
    {
        let api: Api<K> = Api::namespaced(self.lab.client.clone(), NS);
        let done = |o: Option<&K>| {
            o.and_then(&phase)
                .is_some_and(|(p, _)| matches!(p, Phase::Ready | Phase::Failed))
        };
        let got = tokio::time::timeout(DEADLINE, await_condition(api, name, done))
            .await
            .map_err(|_| format!("{name} not done within {DEADLINE:?}\n{}", self.lab.logs()))?
            .context(|| format!("watching {name}"))?
            .ok_or_else(|| format!("{name} was deleted"))?;
        match phase(&got) {
            Some((Phase::Ready, _)) => Ok(got),
            other => Err(format!("{name} failed: {other:?}\n{}", self.lab.logs()).into()),
        }
    }

    /// The shim's incremental Snapshot `id` of the agent pod, as the
    /// controller calls it.
    async fn shim_snapshot(&self, id: &str) -> Result<(), Error> {
        self.shim
            .snapshot(&self.sandbox, id, SnapshotMode::Incremental)
            .await
            .context(|| format!("the shim's Snapshot {id}"))?;
        Ok(())
    }

    /// Snapshot object → Ready, against the shim's Snapshot, alternating.
    async fn snapshots(&self, rounds: usize, report: &mut Report) -> Result<(), Error> {
        let (mut objects, mut shims) = (Vec::new(), Vec::new());
        for i in 0..rounds {
            let t = Instant::now();
            self.object_snapshot(&format!("snap-{i}"), "agent").await?;
            objects.push(t.elapsed());
            let t = Instant::now();
            self.shim_snapshot(&format!("bench-snap-{i}")).await?;
            shims.push(t.elapsed());
        }
        self.lab.step("snapshots measured");
        compare(report, "snapshot", &objects, &shims);
        Ok(())
    }

    /// Rollback object → Ready → the pod answers, against the shim's
    /// Rollback → the pod answers; without a safety snapshot, then with.
    async fn rollbacks(&self, rounds: usize, report: &mut Report) -> Result<(), Error> {
        let target = self.object_snapshot("rewind-to", "agent").await?;
        for safety in [false, true] {
            let (mut objects, mut shims) = (Vec::new(), Vec::new());
            for i in 0..rounds {
                let name = format!("rewind-{}-{i}", if safety { "safe" } else { "plain" });
                let t = Instant::now();
                testkit::create(
                    &self.lab.client,
                    &Rollback::new(
                        &name,
                        RollbackSpec {
                            pod_name: "agent".into(),
                            snapshot_name: "rewind-to".into(),
                            pod_uid: None,
                            safety_snapshot: safety,
                            failure_deadline_seconds: None,
                        },
                    ),
                )
                .await;
                self.until_done(&name, |r: &Rollback| {
                    r.status.as_ref().map(|s| (s.phase, s.message.clone()))
                })
                .await?;
                self.answers().await?;
                objects.push(t.elapsed());
                let t = Instant::now();
                if safety {
                    self.shim_snapshot(&format!("bench-{name}-safety")).await?;
                }
                self.shim
                    .rollback(&self.sandbox, &target, &format!("bench-{name}"))
                    .await
                    .context(|| "the shim's Rollback".into())?;
                self.answers().await?;
                shims.push(t.elapsed());
            }
            let key = if safety {
                "rollback_safety"
            } else {
                "rollback"
            };
            compare(report, key, &objects, &shims);
        }
        self.lab.step("rollbacks measured");
        Ok(())
    }

    /// Clone of `n` → Ready, against `n` restore-from pods through CRI.
    async fn clones(&self, n: usize, source: &str, report: &mut Report) -> Result<(), Error> {
        let name = format!("fan-{n}");
        let replicas = i32::try_from(n).context(|| format!("{n} replicas"))?;
        let mark = self.starts_mark()?;
        let watch = self.watch_node(format!("Clone of {n}"), mark);
        let t = Instant::now();
        testkit::create(
            &self.lab.client,
            &PodClone::new(
                &name,
                CloneSpec {
                    source: CloneSource {
                        snapshot_name: Some("clone-source".into()),
                        pod_name: None,
                    },
                    replicas,
                    name_prefix: None,
                    labels: None,
                    failure_deadline_seconds: None,
                },
            ),
        )
        .await;
        let done = self
            .until_done(&name, |c: &PodClone| {
                c.status.as_ref().map(|s| (s.phase, s.message.clone()))
            })
            .await?;
        let object = t.elapsed();
        drop(watch);
        let ready = done.status.map(|s| s.ready_replicas).unwrap_or_default();
        if ready != replicas {
            return Err(format!("Clone {name} is Ready with {ready} of {n} pods").into());
        }
        self.lab.step(&format!("Clone of {n} Ready"));
        self.idle_cost(&format!("clone{n}"), report).await;
        let mark = self.starts(mark, &format!("clone{n}_object"), report)?;
        let clones: Api<PodClone> = Api::namespaced(self.lab.client.clone(), NS);
        clones
            .delete(&name, &DeleteParams::default())
            .await
            .context(|| format!("deleting Clone {name}"))?;
        self.until_left(1).await?;

        let watch = self.watch_node(format!("{n} restore-from pods"), mark);
        let t = Instant::now();
        let pods = try_join_all((0..n).map(|i| self.restore_pod(i, n, source))).await;
        let shim = t.elapsed();
        drop(watch);
        let pods = pods?;
        self.lab.step(&format!("{n} restore-from pods started"));
        self.starts(mark, &format!("clone{n}_shim"), report)?;
        try_join_all(pods.iter().map(|id| async move {
            self.cri()
                .stop_pod_sandbox(id)
                .await
                .map_err(|e| self.lab.node.cri_error("StopPodSandbox", e))?;
            self.cri()
                .remove_pod_sandbox(id)
                .await
                .map_err(|e| self.lab.node.cri_error("RemovePodSandbox", e))
        }))
        .await?;
        self.until_left(1).await?;
        compare(report, &format!("clone{n}"), &[object], &[shim]);
        Ok(())
    }

    /// The node's containerd log (the shims' logs are copied into it).
    fn containerd_log(&self) -> Result<std::path::PathBuf, Error> {
        Ok(self
            .lab
            .node
            .node()
            .dir()?
            .join("containerd/containerd.log"))
    }

    /// The shims' sandbox starts logged so far (containerd copies each
    /// shim's log into its own): each one's gate wait and start time.
    fn logged_starts(&self) -> Result<Vec<(Duration, Duration)>, Error> {
        let log = self.containerd_log()?;
        let text = std::fs::read_to_string(&log).context(|| format!("{}", log.display()))?;
        let field = |line: &str, name: &str| -> Option<Duration> {
            let rest = &line[line.find(&format!("{name}="))? + name.len() + 1..];
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            digits.parse().ok().map(Duration::from_micros)
        };
        Ok(text
            .lines()
            .filter(|l| l.contains("sandbox VM restored, agent answers"))
            .filter_map(|l| Some((field(l, "gate_wait_us")?, field(l, "launch_us")?)))
            .collect())
    }

    /// How many sandbox starts are logged so far.
    fn starts_mark(&self) -> Result<usize, Error> {
        Ok(self.logged_starts()?.len())
    }

    /// Records the sandbox starts logged after the first `mark` as
    /// `key_gate_wait_ms` (waiting for the node's start gate) and
    /// `key_start_ms` (taking the VM, restoring it, its agent answering):
    /// the new mark.
    fn starts(&self, mark: usize, key: &str, report: &mut Report) -> Result<usize, Error> {
        let all = self.logged_starts()?;
        let new = all.get(mark..).unwrap_or_default();
        if new.is_empty() {
            return Err(format!("no sandbox start logged for {key}").into());
        }
        let (waits, starts): (Vec<Duration>, Vec<Duration>) = new.iter().copied().unzip();
        report.timing(&format!("{key}_gate_wait_ms"), &waits);
        report.timing(&format!("{key}_start_ms"), &starts);
        Ok(all.len())
    }

    /// A clone pod as the kubelet runs it, without the controller: its
    /// sandbox id once its container started.
    async fn restore_pod(&self, i: usize, n: usize, source: &str) -> Result<String, Error> {
        let name = format!("direct-{n}-{i}");
        let logs = self.lab.node.node().dir()?.join("bench-pods").join(&name);
        std::fs::create_dir_all(&logs).context(|| format!("{}", logs.display()))?;
        let mut config = twig_cri::pod_sandbox_config(&name, &format!("uid-{name}"), &logs);
        if let Some(m) = config.metadata.as_mut() {
            m.namespace = NS.into();
        }
        twig_cri::on_node_network(&mut config);
        config
            .annotations
            .insert(RESTORE_FROM_ANNOTATION.into(), source.into());
        config.annotations.insert(
            twig_proto::contract::NETWORK_ANNOTATION.into(),
            twig_proto::contract::NETWORK_NONE.into(),
        );
        let pod = self
            .cri()
            .run_pod_sandbox(&config, twig_controller::crd::RUNTIME_CLASS)
            .await
            .map_err(|e| self.lab.node.cri_error(&format!("RunPodSandbox {name}"), e))?;
        let container = twig_cri::container_config(
            CONTAINER,
            twig_e2e::IMAGE_REF,
            &["/bin/sh", "-c", FORK_SOURCE],
            "agent.log",
        );
        let id = self
            .cri()
            .create_container(&pod, &container, &config)
            .await
            .map_err(|e| {
                self.lab
                    .node
                    .cri_error(&format!("CreateContainer {name}"), e)
            })?;
        self.cri().start_container(&id).await.map_err(|e| {
            self.lab
                .node
                .cri_error(&format!("StartContainer {name}"), e)
        })?;
        Ok(pod)
    }

    /// Prints, every [`WATCH_EVERY`] until aborted, how busy the node was
    /// and which programs used its CPUs, and how many sandboxes have
    /// started: where a slow Clone's time goes.
    fn watch_node(&self, key: String, mark: usize) -> Watch {
        let log = self.containerd_log().ok();
        let t0 = self.lab.t0;
        Watch(tokio::spawn(async move {
            let mut before = cost::node_look();
            loop {
                tokio::time::sleep(WATCH_EVERY).await;
                let now = cost::node_look();
                let started = log
                    .as_ref()
                    .and_then(|l| std::fs::read_to_string(l).ok())
                    .map_or(0, |t| {
                        t.matches("sandbox VM restored, agent answers").count()
                    });
                eprintln!(
                    "objects: {:8.2} s  {key}: {} sandboxes started; {}",
                    t0.elapsed().as_secs_f64(),
                    started.saturating_sub(mark),
                    cost::NodeCost::between(&before, &now)
                );
                before = now;
            }
        }))
    }

    /// Deletes the agent pod and waits until its sandbox is gone.
    async fn remove_agent(&self) -> Result<(), Error> {
        let pods: Api<Pod> = Api::namespaced(self.lab.client.clone(), NS);
        pods.delete("agent", &DeleteParams::default())
            .await
            .context(|| "deleting the agent pod".into())?;
        self.until_left(0).await?;
        self.lab.step("agent pod removed");
        Ok(())
    }

    /// What the node's pods' VMs cost while nobody asks anything of them:
    /// `key_idle_cpu_ms_per_s` (all VMMs' CPU time, their guests' included,
    /// per second of [`IDLE_WINDOW`]) and `key_idle_exits_per_s` (their VM
    /// exits), and how busy the whole node was meanwhile
    /// (`key_idle_node_busy`, its programs printed). Never a failure: a VMM
    /// may go meanwhile.
    async fn idle_cost(&self, key: &str, report: &mut Report) {
        let vmms = self.lab.node.pod_vmms();
        let node = cost::node_look();
        let before: Vec<_> = vmms.iter().filter_map(|&p| cost::look(p)).collect();
        // A measurement window: the pods are left alone for it.
        tokio::time::sleep(IDLE_WINDOW).await;
        let after: Vec<_> = vmms.iter().filter_map(|&p| cost::look(p)).collect();
        let node = cost::NodeCost::between(&node, &cost::node_look());
        eprintln!("objects: {key}: the node while its pods idled: {node}");
        report.value(
            &format!("{key}_idle_node_busy"),
            json!((node.busy * 1000.0).round() / 1000.0),
        );
        if before.len() != after.len() || before.is_empty() {
            eprintln!("objects: {key}: the VMMs changed while watched; no idle cost");
            return;
        }
        let costs: Vec<_> = before
            .iter()
            .zip(&after)
            .map(|(b, a)| cost::Cost::between(b, a))
            .collect();
        let cpu: f64 = costs.iter().map(|c| c.cpu_ms_per_s).sum();
        let exits: f64 = costs.iter().map(cost::Cost::exits_per_s).sum();
        eprintln!(
            "objects: {key}: {} idle VMs: {cpu:.0} ms CPU/s, {exits:.0} exits/s in all",
            costs.len()
        );
        report.value(&format!("{key}_idle_vms"), json!(costs.len()));
        report.value(&format!("{key}_idle_cpu_ms_per_s"), json!(cpu.round()));
        report.value(&format!("{key}_idle_exits_per_s"), json!(exits.round()));
    }

    /// Waits until no clone pod is left and the node holds `n` pod
    /// sandboxes.
    async fn until_left(&self, n: usize) -> Result<(), Error> {
        let pods: Api<Pod> = Api::namespaced(self.lab.client.clone(), NS);
        let deadline = Instant::now() + DEADLINE;
        loop {
            let left = pods
                .list(&ListParams::default().labels(CLONE_LABEL))
                .await
                .context(|| "listing the clone pods".into())?
                .items
                .len();
            let sandboxes = self
                .cri()
                .list_pod_sandboxes()
                .await
                .map_err(|e| self.lab.node.cri_error("ListPodSandbox", e))?
                .len();
            if left == 0 && sandboxes == n {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "{left} clone pods and {sandboxes} sandboxes (not {n}) there after {DEADLINE:?}\n{}",
                    self.lab.logs()
                )
                .into());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// The task of [`Bench::watch_node`], stopped when dropped.
struct Watch(tokio::task::JoinHandle<()>);

impl Drop for Watch {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Records `key_objects_ms`, `key_shim_ms` and the controller's overhead
/// (the difference of the p50s) and prints them.
fn compare(report: &mut Report, key: &str, objects: &[Duration], shims: &[Duration]) {
    report.timing(&format!("{key}_object_ms"), objects);
    report.timing(&format!("{key}_shim_ms"), shims);
    let (o, s) = (Summary::of(objects).p50, Summary::of(shims).p50);
    report.value(
        &format!("{key}_overhead_ms"),
        json!(((o - s) * 10.0).round() / 10.0),
    );
}
