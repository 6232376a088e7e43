//! Pod start through containerd's own CRI plugin, as kubelet drives it:
//! RunPodSandbox + CreateContainer + StartContainer until the container's
//! first output line appears in the log file CRI writes (polled every 1 ms),
//! at several concurrencies, for each runtime handler given — `runc` today,
//! `twig=io.containerd.twig.v2` once the shim exists, in the same run and
//! the same environment, so the ratio between them is the figure. Pods of
//! the handlers are interleaved (pod `i` uses handler `i mod n`), so slow
//! drifts in the machine's load hit every handler alike.
//!
//! Everything runs on a `twig_cri::Node`: its own containerd, CNI bridge and
//! local registry (needs root). Teardown of each pod is not timed; at
//! concurrency > 1 it overlaps other pods' starts, as on a busy node.

use crate::stats::{Context, Error, Report, Summary};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use twig_cri::{
    container_config, logs, pod_sandbox_config, CriClient, Node, NodeOptions, RuntimeHandler,
};

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
}

/// An error that can cross tasks.
type SendError = Box<dyn std::error::Error + Send + Sync>;

/// The timings of one pod start.
#[derive(Default, Clone, Copy)]
struct Sample {
    run_pod_sandbox: Duration,
    create_container: Duration,
    start_container: Duration,
    first_output: Duration,
}

pub fn run(args: &Args) -> Result<Value, Error> {
    if args.concurrency.contains(&0) {
        return Err("--concurrency values must be at least 1".into());
    }
    let node = Node::start(&NodeOptions {
        runtimes: args.handlers.clone(),
    })
    .context(|| "starting containerd with its CRI plugin".into())?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context(|| "tokio runtime".into())?;
    rt.block_on(measure(args, &node))
}

async fn measure(args: &Args, node: &Node) -> Result<Value, Error> {
    let cri = node.client().await?;
    let version = cri.version().await?;
    let image = node.busybox_image().to_string();
    cri.pull_image(&image).await?;
    let mut r = Report::default();
    r.value(
        "runtime",
        json!(format!(
            "{} {}",
            version.runtime_name, version.runtime_version
        )),
    );
    r.value("load_average_before", json!(load_average()));
    let pods = Pods {
        cri,
        handlers: args.handlers.iter().map(|h| h.name.clone()).collect(),
        image,
        logs: node.dir().join("bench-pods"),
    };
    for (h, name) in pods.handlers.iter().enumerate() {
        for i in 0..args.warmup {
            pods.start_one(h, &format!("warmup-{i}"))
                .await
                .context(|| format!("warm-up pod with handler {name}"))?;
        }
    }
    let mut p50 = Vec::new();
    let mut p99 = Vec::new();
    for &c in &args.concurrency {
        let t0 = Instant::now();
        let samples = pods.run_concurrently(args.runs, c).await?;
        r.value(
            &format!("c{c}_pods_per_s"),
            json!(samples.len() as f64 / t0.elapsed().as_secs_f64()),
        );
        for (h, name) in pods.handlers.iter().enumerate() {
            let mine: Vec<Sample> = samples
                .iter()
                .filter(|(i, _)| *i == h)
                .map(|(_, s)| *s)
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
        }
    }
    if args.handlers.len() > 1 {
        ratios(&mut r, "p50", &p50);
        ratios(&mut r, "p99", &p99);
    }
    r.value("load_average_after", json!(load_average()));
    Ok(r.into_value())
}

/// Prints and records p50/p90/p99/max; returns the summary and its p99.
fn summary(r: &mut Report, key: &str, samples: &[Duration]) -> (Summary, f64) {
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
    /// The runtime handlers, taken in turn pod by pod.
    handlers: Vec<String>,
    image: String,
    /// Where each pod's log directory goes.
    logs: PathBuf,
}

impl Pods {
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
                                pods.handlers[h]
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
        let handler = &self.handlers[handler];
        let pod_name = format!("bench-{handler}-{name}");
        let log_dir = self.logs.join(&pod_name);
        std::fs::create_dir_all(&log_dir)
            .map_err(|e| format!("creating {}: {e}", log_dir.display()))?;
        let pod = pod_sandbox_config(&pod_name, &pod_name, &log_dir);
        let config = container_config(
            "app",
            &self.image,
            &["/bin/sh", "-c", &format!("echo {READY}; exec sleep 3600")],
            "app.log",
        );
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
            })
        }
        .await;
        self.cri.stop_pod_sandbox(&pod_id).await?;
        self.cri.remove_pod_sandbox(&pod_id).await?;
        result
    }
}
