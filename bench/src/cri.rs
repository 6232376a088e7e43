//! Pod start through containerd's own CRI plugin, as kubelet drives it:
//! RunPodSandbox + CreateContainer + StartContainer until the container's
//! first output line appears in the log file CRI writes (polled every 1 ms),
//! at several concurrencies, for each runtime handler given — `runc` today,
//! `twig=io.containerd.twig.v2` once the shim exists, in the same run and
//! the same environment, so the ratio between them is the figure. Pods of
//! the handlers are interleaved (pod `i` uses handler `i mod n`), so slow
//! drifts in the machine's load hit every handler alike.
//!
//! Everything runs on a node of its own (needs root): on the host
//! (`--node host`) a `twig_cri::Node` (containerd, CNI bridge, local
//! registry; runc only, Linux guests do not run here); in the nested lab
//! (`--node lab`, `tests/lab/run.sh --bench cri`) a `twig_e2e::cri::CriNode`
//! (containerd with twig-snapshotter under every handler, the twig shim, the
//! images imported from archives), where the handlers are `runc` and `twig`.
//! Teardown of each pod is not timed; at concurrency > 1 it overlaps other
//! pods' starts, as on a busy node.
//!
//! With `--volumes` every handler also runs pods with the volume set an
//! ordinary pod has (kubelet's projected ServiceAccount token, a ConfigMap,
//! a Secret, an emptyDir, laid out as kubelet writes them), interleaved
//! with the pods without in the same run: `<handler>+volumes` rows.
//!
//! With `--shared-dir N` it also times file work on a host directory bound
//! into a pod, N rounds per handler (`shared_dir.rs`).
//!
//! In the lab it also measures, per handler, the host memory of an idle pod
//! (its shim, its VMM or containers: resident and anonymous, the latter
//! being what the pod owns, not the template's shared page cache) and, for
//! twig, the time the shim spends in Create and Start outside the VM (the
//! shim's `timing` log lines, which containerd copies into its log).

use crate::stats::{Context, Error, Report, Summary};
use serde_json::{json, Value};
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use twig_cri::{
    container_config, logs, pod_sandbox_config, CriClient, Node, NodeOptions, RuntimeHandler,
};
use twig_e2e::cgroup::PodCgroup;
use twig_e2e::cri::CriNode;

/// What the container prints first.
const READY: &str = "ready";
/// How long one pod may take to print it.
const FIRST_OUTPUT_DEADLINE: Duration = Duration::from_secs(120);

#[derive(clap::Args)]
pub struct Args {
    /// CRI runtime handler, NAME or NAME=RUNTIME_TYPE (runtime type
    /// defaults to io.containerd.runc.v2); repeat to compare handlers, the
    /// first is the baseline of the ratios.
    #[arg(long = "handler", default_value = "runc", value_parser = RuntimeHandler::parse)]
    handlers: Vec<RuntimeHandler>,
    /// Timed pods per handler and concurrency.
    #[arg(long, default_value_t = 40)]
    runs: usize,
    /// Concurrencies to measure (pods started at the same time).
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    concurrency: Vec<usize>,
    /// Untimed pods per handler first (image unpack, first shim start).
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Where the pods run: `host` (twig-cri's node) or `lab` (twig-e2e's
    /// node, inside tests/lab/run.sh; handlers `runc` and `twig`).
    #[arg(long, value_enum, default_value = "host")]
    node: NodeKind,
    /// Idle pods per handler kept running at once to measure their host
    /// memory (lab only; 0: not measured).
    #[arg(long, default_value_t = 4)]
    idle_pods: usize,
    /// Also start each handler's pods with an ordinary pod's volumes (a
    /// ServiceAccount token, a ConfigMap, a Secret, an emptyDir).
    #[arg(long)]
    volumes: bool,
    /// Also time file work on a host directory bound into a pod
    /// (`shared_dir.rs`), this many rounds per handler (0: not measured).
    #[arg(long, default_value_t = 0)]
    shared_dir: usize,
}

/// Where the benchmark's pods run.
#[derive(Clone, Copy, clap::ValueEnum)]
enum NodeKind {
    /// twig-cri's node on this host: local registry, overlayfs, runc.
    Host,
    /// twig-e2e's node in the nested lab: twig-snapshotter, runc and twig.
    Lab,
}

/// The handlers twig-e2e's node configures.
const LAB_HANDLERS: [&str; 2] = ["runc", "twig"];
/// Ready twig-net sets the lab node's twig-node keeps for the shims (the
/// concurrency the benchmark runs at).
const LAB_NET_POOL: usize = 8;

/// A started node of either kind.
enum BenchNode {
    Host(Node),
    Lab(CriNode),
}

impl BenchNode {
    fn start(args: &Args) -> Result<BenchNode, Error> {
        match args.node {
            NodeKind::Host => Ok(BenchNode::Host(
                Node::start(&NodeOptions {
                    runtimes: args.handlers.clone(),
                })
                .context(|| "starting containerd with its CRI plugin".into())?,
            )),
            NodeKind::Lab => {
                if let Some(h) = args
                    .handlers
                    .iter()
                    .find(|h| !LAB_HANDLERS.contains(&h.name.as_str()))
                {
                    return Err(format!(
                        "handler {}: the lab's node offers only {LAB_HANDLERS:?}",
                        h.name
                    )
                    .into());
                }
                // As a node runs: shims take verified twig-net sets from
                // twig-node's pool.
                let node = CriNode::start_configured(|c| c.net_pool = LAB_NET_POOL);
                Ok(BenchNode::Lab(node.context(|| {
                    "starting the lab's node (twig-e2e) with CRI".into()
                })?))
            }
        }
    }

    /// A client, and the image the pods run (pulled when on the host).
    async fn client(&self) -> Result<(CriClient, String), Error> {
        match self {
            BenchNode::Host(node) => {
                let cri = node.client().await?;
                let image = node.busybox_image().to_string();
                cri.pull_image(&image).await?;
                Ok((cri, image))
            }
            BenchNode::Lab(node) => Ok((node.client().await?, twig_e2e::IMAGE_REF.to_string())),
        }
    }

    fn dir(&self) -> Result<PathBuf, Error> {
        match self {
            BenchNode::Host(node) => Ok(node.dir().to_path_buf()),
            BenchNode::Lab(node) => Ok(node.node().dir()?.to_path_buf()),
        }
    }
}

/// An error that can cross tasks.
type SendError = Box<dyn std::error::Error + Send + Sync>;

/// The timings of one pod start.
#[derive(Default, Clone)]
struct Sample {
    run_pod_sandbox: Duration,
    create_container: Duration,
    start_container: Duration,
    first_output: Duration,
    /// The pod sandbox's id (its sandbox container's too).
    pod_id: String,
    /// The container's id.
    container_id: String,
}

pub fn run(args: &Args) -> Result<Value, Error> {
    if args.concurrency.contains(&0) {
        return Err("--concurrency values must be at least 1".into());
    }
    let node = BenchNode::start(args)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context(|| "tokio runtime".into())?;
    rt.block_on(measure(args, &node))
}

async fn measure(args: &Args, node: &BenchNode) -> Result<Value, Error> {
    let (cri, image) = node.client().await?;
    let version = cri.version().await?;
    let dir = node.dir()?;
    let mut r = Report::default();
    r.value(
        "runtime",
        json!(format!(
            "{} {}",
            version.runtime_name, version.runtime_version
        )),
    );
    r.value("load_average_before", json!(load_average()));
    let with_volumes: &[bool] = if args.volumes {
        &[false, true]
    } else {
        &[false]
    };
    let pods = Pods {
        cri,
        handlers: with_volumes
            .iter()
            .flat_map(|v| args.handlers.iter().map(move |h| (h.name.clone(), *v)))
            .collect(),
        image,
        logs: dir.join("bench-pods"),
    };
    for (h, name) in pods.names().iter().enumerate() {
        for i in 0..args.warmup {
            pods.start_one(h, &format!("warmup-{i}"))
                .await
                .context(|| format!("warm-up pod with handler {name}"))?;
        }
    }
    let mut p50 = Vec::new();
    let mut p99 = Vec::new();
    let mut all = Vec::new();
    for &c in &args.concurrency {
        let t0 = Instant::now();
        let samples = pods.run_concurrently(args.runs, c).await?;
        r.value(
            &format!("c{c}_pods_per_s"),
            json!(samples.len() as f64 / t0.elapsed().as_secs_f64()),
        );
        for (h, name) in pods.names().iter().enumerate() {
            let mine: Vec<Sample> = samples
                .iter()
                .filter(|(i, _)| *i == h)
                .map(|(_, s)| s.clone())
                .collect();
            let key = format!("{name}_c{c}");
            let firsts: Vec<Duration> = mine.iter().map(|s| s.first_output).collect();
            let (s, s99) = summary(&mut r, &format!("{key}_first_output_ms"), &firsts);
            p50.push((name.clone(), c, s.p50));
            p99.push((name.clone(), c, s99));
            for (phase, pick) in [
                (
                    "run_pod_sandbox",
                    (|s: &Sample| s.run_pod_sandbox) as fn(&Sample) -> Duration,
                ),
                ("create_container", |s| s.create_container),
                ("start_container", |s| s.start_container),
            ] {
                let v: Vec<Duration> = mine.iter().map(pick).collect();
                summary(&mut r, &format!("{key}_{phase}_ms"), &v);
            }
            if matches!(node, BenchNode::Lab(_)) && name == "twig" {
                shim_time(&mut r, &key, &dir.join("containerd/containerd.log"), &mine);
            }
        }
        all.extend(samples);
    }
    if pods.handlers.len() > 1 {
        ratios(&mut r, "p50", &p50);
        ratios(&mut r, "p99", &p99);
    }
    if let (BenchNode::Lab(lab), true) = (node, args.idle_pods > 0) {
        for (h, (name, volumes)) in pods.handlers.iter().enumerate() {
            if *volumes {
                continue;
            }
            idle_memory(&mut r, lab, &pods, h, args.idle_pods, &dir)
                .await
                .context(|| format!("idle pods with handler {name}"))?;
        }
    }
    if args.shared_dir > 0 {
        let names: Vec<String> = args.handlers.iter().map(|h| h.name.clone()).collect();
        crate::shared_dir::measure(
            &mut r,
            &pods.cri,
            &pods.image,
            &names,
            &dir.join("bench-shared-dir"),
            args.shared_dir,
        )
        .await
        .context(|| "the shared directory".into())?;
    }
    r.value("load_average_after", json!(load_average()));
    Ok(r.into_value())
}

/// The volumes an ordinary pod has, laid out under `pod_dir` as kubelet
/// lays them out (`volumes/kubernetes.io~<plugin>/<name>`, written by
/// kubelet's atomic writer), and the container's mounts of them: the
/// projected ServiceAccount token (token, CA bundle, namespace), a
/// ConfigMap and a Secret of a few keys, an emptyDir.
fn ordinary_volumes(pod_dir: &Path) -> Result<Vec<twig_cri::api::Mount>, SendError> {
    use twig_e2e::kubelet::{AtomicWriter, FileProjection, Payload};
    let file = |data: &str, mode: u32| FileProjection {
        data: data.as_bytes().to_vec(),
        mode,
    };
    let volumes = pod_dir.join("volumes");
    let token: Payload = [
        ("token", file(&"t".repeat(900), 0o644)),
        ("ca.crt", file(&"c".repeat(1100), 0o644)),
        ("namespace", file("default", 0o644)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let config: Payload = (0..4)
        .map(|i| (format!("key{i}"), file(&format!("value {i}\n"), 0o644)))
        .collect();
    let secret: Payload = [("password", file("s3cret", 0o600))]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    let mut mounts = Vec::new();
    for (plugin, name, payload, at) in [
        (
            "projected",
            "kube-api-access-bench",
            Some(token),
            "/var/run/secrets/kubernetes.io/serviceaccount",
        ),
        ("configmap", "config", Some(config), "/etc/config"),
        ("secret", "secret", Some(secret), "/etc/secret"),
        ("empty-dir", "scratch", None, "/scratch"),
    ] {
        let dir = volumes.join(format!("kubernetes.io~{plugin}")).join(name);
        std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        if let Some(p) = payload {
            AtomicWriter::new(&dir).write(&p)?;
        }
        mounts.push(twig_cri::api::Mount {
            container_path: at.into(),
            host_path: dir.to_string_lossy().into_owned(),
            readonly: plugin != "empty-dir",
            ..Default::default()
        });
    }
    Ok(mounts)
}

/// Prints and records p50/p90/p99/max; returns the summary and its p99.
pub(crate) fn summary(r: &mut Report, key: &str, samples: &[Duration]) -> (Summary, f64) {
    let s = Summary::of(samples);
    let p99 = percentile(samples, 0.99);
    eprintln!(
        "{key:<40} p50 {:>8.1} ms  p90 {:>8.1} ms  p99 {:>8.1} ms  max {:>8.1} ms  (n={})",
        s.p50, s.p90, p99, s.max, s.runs
    );
    r.insert(
        key,
        json!({ "p50": s.p50, "p90": s.p90, "p99": p99, "max": s.max, "runs": s.runs }),
    );
    (s, p99)
}

/// The `q` quantile in milliseconds (nearest rank).
fn percentile(samples: &[Duration], q: f64) -> f64 {
    let mut ms: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e3).collect();
    ms.sort_by(f64::total_cmp);
    let rank = (q * ms.len() as f64).ceil() as usize;
    ms.get(rank.saturating_sub(1)).copied().unwrap_or(f64::NAN)
}

/// Each handler's figure over the first handler's, per concurrency.
fn ratios(r: &mut Report, what: &str, figures: &[(String, usize, f64)]) {
    let Some((base, _, _)) = figures.first() else {
        return;
    };
    for (name, c, v) in figures.iter().filter(|(n, _, _)| n != base) {
        if let Some((_, _, b)) = figures.iter().find(|(n, bc, _)| n == base && bc == c) {
            r.value(
                &format!("ratio_{what}_c{c}_{name}_over_{base}"),
                json!(v / b),
            );
        }
    }
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// Starts pods on the node.
#[derive(Clone)]
struct Pods {
    cri: CriClient,
    /// The runtime handlers, each without or with an ordinary pod's
    /// volumes, taken in turn pod by pod.
    handlers: Vec<(String, bool)>,
    image: String,
    /// Where each pod's log directory goes.
    logs: PathBuf,
}

impl Pods {
    /// The rows' names: the handler's, `+volumes` when its pods have them.
    fn names(&self) -> Vec<String> {
        self.handlers
            .iter()
            .map(|(h, v)| {
                if *v {
                    format!("{h}+volumes")
                } else {
                    h.clone()
                }
            })
            .collect()
    }

    /// `runs` pods per handler, `concurrency` at a time, each worker its
    /// own task; pod `i` uses handler `i mod handlers`, so the handlers are
    /// interleaved and share the machine's drift in load. Each sample comes
    /// with its handler's index.
    async fn run_concurrently(
        &self,
        runs: usize,
        concurrency: usize,
    ) -> Result<Vec<(usize, Sample)>, Error> {
        let total = runs * self.handlers.len();
        let next = Arc::new(AtomicUsize::new(0));
        let mut workers = tokio::task::JoinSet::new();
        for _ in 0..concurrency.min(total) {
            let (next, pods) = (Arc::clone(&next), self.clone());
            workers.spawn(async move {
                let mut out = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= total {
                        return Ok::<_, String>(out);
                    }
                    let h = i % pods.handlers.len();
                    let sample = pods.start_one(h, &format!("c{concurrency}-{i}")).await;
                    out.push((
                        h,
                        sample.map_err(|e| {
                            format!(
                                "pod {i} with handler {} at concurrency {concurrency}: {e}",
                                pods.handlers[h].0
                            )
                        })?,
                    ));
                }
            });
        }
        let mut samples = Vec::with_capacity(total);
        while let Some(worker) = workers.join_next().await {
            samples.extend(worker.context(|| "a benchmark worker".into())??);
        }
        Ok(samples)
    }

    /// One timed pod start, then its untimed removal.
    async fn start_one(&self, handler: usize, name: &str) -> Result<Sample, SendError> {
        let (handler, volumes) = &self.handlers[handler];
        let pod_name = format!("bench-{handler}-{}{name}", if *volumes { "v-" } else { "" });
        let log_dir = self.logs.join(&pod_name);
        std::fs::create_dir_all(&log_dir)
            .map_err(|e| format!("creating {}: {e}", log_dir.display()))?;
        let pod = pod_sandbox_config(&pod_name, &pod_name, &log_dir);
        let mut config = container_config(
            "app",
            &self.image,
            &["/bin/sh", "-c", &format!("echo {READY}; exec sleep 3600")],
            "app.log",
        );
        if *volumes {
            config.mounts = ordinary_volumes(&self.logs.join(&pod_name).join("kubelet"))?;
        }
        let log = Node::container_log(&pod, "app.log");
        let t0 = Instant::now();
        let pod_id = self.cri.run_pod_sandbox(&pod, handler).await?;
        let t1 = Instant::now();
        let result = async {
            let id = self.cri.create_container(&pod_id, &config, &pod).await?;
            let t2 = Instant::now();
            self.cri.start_container(&id).await?;
            let t3 = Instant::now();
            logs::wait_for(&log, FIRST_OUTPUT_DEADLINE, |lines| {
                lines.iter().any(|l| l.text == READY)
            })
            .await?;
            Ok::<_, SendError>(Sample {
                run_pod_sandbox: t1 - t0,
                create_container: t2 - t1,
                start_container: t3 - t2,
                first_output: t0.elapsed(),
                pod_id: pod_id.clone(),
                container_id: id,
            })
        }
        .await;
        self.remove(&pod_id).await?;
        result
    }

    /// Starts a pod whose container has printed its first line and keeps
    /// it; returns the pod's id.
    /// An idle pod (a container that sleeps) of `handler`, in the pod
    /// cgroup `cgroup_parent`.
    async fn start_idle(
        &self,
        handler: usize,
        name: &str,
        cgroup_parent: &str,
    ) -> Result<String, SendError> {
        let handler = &self.handlers[handler].0;
        let pod_name = format!("idle-{handler}-{name}");
        let log_dir = self.logs.join(&pod_name);
        std::fs::create_dir_all(&log_dir)
            .map_err(|e| format!("creating {}: {e}", log_dir.display()))?;
        let mut pod = pod_sandbox_config(&pod_name, &pod_name, &log_dir);
        pod.linux.get_or_insert_with(Default::default).cgroup_parent = cgroup_parent.to_string();
        let config = container_config(
            "app",
            &self.image,
            &["/bin/sh", "-c", &format!("echo {READY}; exec sleep 3600")],
            "app.log",
        );
        let pod_id = self.cri.run_pod_sandbox(&pod, handler).await?;
        let id = self.cri.create_container(&pod_id, &config, &pod).await?;
        self.cri.start_container(&id).await?;
        logs::wait_for(
            &Node::container_log(&pod, "app.log"),
            FIRST_OUTPUT_DEADLINE,
            |lines| lines.iter().any(|l| l.text == READY),
        )
        .await?;
        Ok(pod_id)
    }

    async fn remove(&self, pod_id: &str) -> Result<(), SendError> {
        self.cri.stop_pod_sandbox(pod_id).await?;
        self.cri.remove_pod_sandbox(pod_id).await?;
        Ok(())
    }
}

/// The `key=value` fields of one twig shim log line carrying `marker`
/// (quotes stripped).
fn fields<'a>(line: &'a str, marker: &str) -> Option<HashMap<&'a str, &'a str>> {
    line.contains(marker).then(|| {
        line.split_whitespace()
            .filter_map(|f| f.split_once('='))
            .map(|(k, v)| (k, v.trim_matches('"')))
            .collect()
    })
}

/// One `timing` line of the twig shim: a Create or Start, how much of it
/// was the shim's own time (`own_us`) and how much waiting on the VM
/// (`vm_us`).
fn parse_timing(line: &str) -> Option<(String, u64, u64)> {
    let f = fields(line, " timing ")?;
    Some((
        f.get("id")?.to_string(),
        f.get("own_us")?.parse().ok()?,
        f.get("vm_us")?.parse().ok()?,
    ))
}

/// One "sandbox VM restored" line: the sandbox, the time to take a VMM from
/// twig-node (`acquired_us`) and the whole launch until the agent answered
/// in the pod's network (`launch_us`).
fn parse_launch(line: &str) -> Option<(String, u64, u64)> {
    let f = fields(line, "sandbox VM restored")?;
    Some((
        f.get("sandbox_id")?.to_string(),
        f.get("acquired_us")?.parse().ok()?,
        f.get("launch_us")?.parse().ok()?,
    ))
}

/// The twig shim's time per pod from containerd's log: its own (Create and
/// Start of the sandbox and of the container, outside the VM), its waits on
/// the VM, and the sandbox VM's launch (taking a VMM, and all of it).
fn shim_time(r: &mut Report, key: &str, containerd_log: &Path, samples: &[Sample]) {
    let text = std::fs::read_to_string(containerd_log).unwrap_or_default();
    let mut own: HashMap<String, (u64, u64)> = HashMap::new();
    for (id, own_us, vm_us) in text.lines().filter_map(parse_timing) {
        let e = own.entry(id).or_default();
        e.0 += own_us;
        e.1 += vm_us;
    }
    let launches: HashMap<String, (u64, u64)> = text
        .lines()
        .filter_map(parse_launch)
        .map(|(id, a, l)| (id, (a, l)))
        .collect();
    // Per pod, in µs: own, waiting on the VM, taking a VMM, the launch.
    let per_pod: Vec<[u64; 4]> = samples
        .iter()
        .filter_map(|s| {
            let pod = own.get(&s.pod_id)?;
            let container = own.get(&s.container_id)?;
            let launch = launches.get(&s.pod_id).copied().unwrap_or_default();
            Some([pod.0 + container.0, pod.1 + container.1, launch.0, launch.1])
        })
        .collect();
    if per_pod.len() < samples.len() {
        eprintln!(
            "{key}: the shim's timing lines cover {} of {} pods",
            per_pod.len(),
            samples.len()
        );
    }
    for (i, name) in ["shim_own", "shim_vm_wait", "vm_acquire", "vm_launch"]
        .iter()
        .enumerate()
    {
        let d: Vec<Duration> = per_pod
            .iter()
            .map(|p| Duration::from_micros(p[i]))
            .collect();
        summary(r, &format!("{key}_{name}_ms"), &d);
    }
    let (prepared, loaded) = net_sets(&text, samples);
    eprintln!("{key}: pod networks from the node's prepared sets: {prepared}, from sets the shim loaded: {loaded}");
    r.value(&format!("{key}_net_sets_prepared"), json!(prepared));
    r.value(&format!("{key}_net_sets_loaded"), json!(loaded));
}

/// How many of the pods' networks were attached from a set the node daemon
/// prepared, and how many from one their shim loaded (the shim's `twig-net
/// set attached` lines, which name the pod's bpffs directory).
fn net_sets(containerd_log: &str, samples: &[Sample]) -> (usize, usize) {
    let (mut prepared, mut loaded) = (0, 0);
    for line in containerd_log
        .lines()
        .filter(|l| l.contains("twig-net set attached"))
    {
        if !samples.iter().any(|s| line.contains(&s.pod_id)) {
            continue;
        }
        if line.contains("prepared=true") {
            prepared += 1;
        } else if line.contains("prepared=false") {
            loaded += 1;
        }
    }
    (prepared, loaded)
}

/// A process's command line, parent and memory (kB): resident and
/// anonymous (`smaps_rollup`).
struct Proc {
    argv: Vec<String>,
    ppid: u32,
    rss_kb: u64,
    anon_kb: u64,
}

fn kb_field(text: &str, key: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn processes() -> HashMap<u32, Proc> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return HashMap::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let argv = std::fs::read(e.path().join("cmdline"))
                .ok()?
                .split(|b| *b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            let status = std::fs::read_to_string(e.path().join("status")).ok()?;
            let rollup = std::fs::read_to_string(e.path().join("smaps_rollup")).unwrap_or_default();
            Some((
                pid,
                Proc {
                    argv,
                    ppid: kb_field(&status, "PPid:") as u32,
                    rss_kb: kb_field(&status, "VmRSS:"),
                    anon_kb: kb_field(&rollup, "Anonymous:"),
                },
            ))
        })
        .collect()
}

/// The pids of the node's pods for `shim` (the shim's binary name): its
/// shims naming the node's directory `dir`, the pods' VMMs `vmms` (twig;
/// twig-node's idle pool is the node's, not a pod's), and their
/// descendants (runc's containers).
fn pod_processes(procs: &HashMap<u32, Proc>, shim: &str, dir: &str, vmms: &[u32]) -> BTreeSet<u32> {
    let names = |p: &Proc, n: &str| {
        p.argv
            .first()
            .is_some_and(|a| a.rsplit('/').next() == Some(n))
    };
    let ours = |p: &Proc| p.argv.iter().any(|a| a.contains(dir));
    let mut set: BTreeSet<u32> = procs
        .iter()
        .filter(|(pid, p)| (ours(p) && names(p, shim)) || vmms.contains(pid))
        .map(|(pid, _)| *pid)
        .collect();
    loop {
        let more: Vec<u32> = procs
            .iter()
            .filter(|(pid, p)| set.contains(&p.ppid) && !set.contains(pid))
            .map(|(pid, _)| *pid)
            .collect();
        if more.is_empty() {
            return set;
        }
        set.extend(more);
    }
}

/// Host memory per idle pod of handler `h`: `count` pods started and idle
/// at once, their processes' resident and anonymous memory summed and
/// divided by `count`; and what their pod cgroups are charged
/// (`memory.current` of each pod's own cgroup, which kubelet would make
/// and bound by the pod's limit plus the RuntimeClass overhead), averaged.
async fn idle_memory(
    r: &mut Report,
    node: &CriNode,
    pods: &Pods,
    h: usize,
    count: usize,
    dir: &Path,
) -> Result<(), Error> {
    let name = &pods.handlers[h].0;
    let shim = if name == "twig" {
        "containerd-shim-twig-v2"
    } else {
        "containerd-shim-runc-v2"
    };
    let top = format!("twig-bench-{}", std::process::id());
    let mut cgroups = Vec::new();
    let mut ids = Vec::new();
    let mut started = Ok(());
    for i in 0..count {
        let cgroup = match PodCgroup::new(&top, &format!("{name}-{i}"), None) {
            Ok(c) => c,
            Err(e) => {
                started = Err(e.into());
                break;
            }
        };
        let parent = cgroup.parent.clone();
        cgroups.push(cgroup);
        match pods.start_idle(h, &i.to_string(), &parent).await {
            Ok(id) => ids.push(id),
            Err(e) => {
                started = Err(e);
                break;
            }
        }
    }
    let vmms = &node.pod_vmms();
    let measured = started.map(|()| {
        let procs = processes();
        let set = pod_processes(&procs, shim, &dir.to_string_lossy(), vmms);
        let (rss, anon) = set
            .iter()
            .filter_map(|pid| procs.get(pid))
            .fold((0, 0), |(r, a), p| (r + p.rss_kb, a + p.anon_kb));
        let charged: Result<u64, String> = cgroups
            .iter()
            .map(|c| c.number("memory.current", None))
            .sum();
        charged.map(|c| (set.len(), rss, anon, c))
    });
    for id in &ids {
        pods.remove(id).await.map_err(|e| e.to_string())?;
    }
    drop(cgroups);
    let (n, rss, anon, charged) = measured.map_err(|e| e.to_string())??;
    let charged_mib = charged as f64 / (1 << 20) as f64 / count as f64;
    let per_pod = |kb: u64| kb as f64 / 1024.0 / count as f64;
    eprintln!(
        "{name}: {count} idle pods, {n} processes: {:.1} MiB resident, {:.1} MiB anonymous per pod",
        per_pod(rss),
        per_pod(anon)
    );
    r.value(&format!("{name}_idle_pod_rss_mib"), json!(per_pod(rss)));
    r.value(&format!("{name}_idle_pod_anon_mib"), json!(per_pod(anon)));
    r.value(&format!("{name}_idle_pod_processes"), json!(n));
    eprintln!("{name}: {charged_mib:.1} MiB charged to each idle pod's cgroup");
    r.value(&format!("{name}_idle_pod_cgroup_mib"), json!(charged_mib));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn net_set_lines_count_prepared_and_loaded_sets_of_the_sampled_pods() {
        let sample = |pod: &str| Sample {
            run_pod_sandbox: Duration::ZERO,
            create_container: Duration::ZERO,
            start_container: Duration::ZERO,
            first_output: Duration::ZERO,
            pod_id: pod.into(),
            container_id: format!("{pod}-c"),
        };
        let log = "x INFO twig_shim::network: twig-net set attached dir=/sys/fs/bpf/twig-n/aaa prepared=true\n\
                   x INFO twig_shim::network: twig-net set attached dir=/sys/fs/bpf/twig-n/bbb prepared=false\n\
                   x INFO twig_shim::network: twig-net set attached dir=/sys/fs/bpf/twig-n/ccc prepared=true\n\
                   x INFO twig_shim::network: timing own_us=1 id=\"aaa\"";
        assert_eq!(net_sets(log, &[sample("aaa"), sample("bbb")]), (1, 1));
        assert_eq!(net_sets(log, &[sample("ccc")]), (1, 0));
        assert_eq!(net_sets(log, &[]), (0, 0));
    }

    #[test]
    fn timing_lines_give_the_shims_own_time() {
        let line = "2026-11-24T11:14:18.370588Z  INFO twig_shim::service: timing call=\"create\" \
                    id=\"fdf76\" exec_id=\"\" own_us=62347 vm_us=22076648";
        assert_eq!(
            parse_timing(line),
            Some(("fdf76".to_string(), 62347, 22076648))
        );
        let start =
            "2026-11-24T11:14:18Z  INFO twig_shim::service: start id=\"fdf76\" exec_id=\"\"";
        assert_eq!(parse_timing(start), None);
        let broken = "x INFO twig_shim::service: timing call=\"create\" id=\"a\" own_us=lots";
        assert_eq!(parse_timing(broken), None);
        let launch =
            "2026-11-24T11:14:18Z  INFO twig_shim::vm: sandbox VM restored, agent answers \
                      sandbox_id=\"fdf76\" pid=12 pooled=true template=\"/x\" acquired_us=812 \
                      launch_us=90210";
        assert_eq!(
            parse_launch(launch),
            Some(("fdf76".to_string(), 812, 90210))
        );
        assert_eq!(parse_launch(line), None);
    }

    #[test]
    fn pod_processes_follow_shims_to_their_children() {
        let p = |argv: &[&str], ppid: u32| Proc {
            argv: argv.iter().map(|s| s.to_string()).collect(),
            ppid,
            rss_kb: 0,
            anon_kb: 0,
        };
        let procs = HashMap::from([
            (
                10,
                p(
                    &["/usr/bin/containerd-shim-runc-v2", "-address", "/n/c.sock"],
                    1,
                ),
            ),
            (11, p(&["/bin/sh"], 10)),
            (12, p(&["sleep"], 11)),
            (
                20,
                p(
                    &[
                        "/usr/local/bin/containerd-shim-twig-v2",
                        "-address",
                        "/n/c.sock",
                    ],
                    1,
                ),
            ),
            (
                21,
                p(
                    &[
                        "/usr/local/bin/twig-vmm",
                        "serve",
                        "--api-sock",
                        "/n/vms/1/api.sock",
                    ],
                    2,
                ),
            ),
            (
                22,
                p(
                    &["/usr/local/bin/twig-vmm", "serve", "/n/vms/2/api.sock"],
                    2,
                ),
            ),
            (
                30,
                p(
                    &[
                        "/usr/bin/containerd-shim-runc-v2",
                        "-address",
                        "/other/c.sock",
                    ],
                    1,
                ),
            ),
        ]);
        let runc = pod_processes(&procs, "containerd-shim-runc-v2", "/n/", &[]);
        assert_eq!(runc.into_iter().collect::<Vec<_>>(), vec![10, 11, 12]);
        // 22 is an idle VMM of twig-node's pool, no pod's.
        let twig = pod_processes(&procs, "containerd-shim-twig-v2", "/n/", &[21]);
        assert_eq!(twig.into_iter().collect::<Vec<_>>(), vec![20, 21]);
    }
}
