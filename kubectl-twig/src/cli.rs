//! The command line: `kubectl twig <command>`, with kubectl's connection flags.

use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::duration::parse_duration;

/// Snapshot, fork and rewind running Twig pods, and follow what happened.
#[derive(Parser, Debug)]
#[command(
    name = "kubectl twig",
    bin_name = "kubectl twig",
    version,
    about = "Snapshot, fork and rewind running Twig pods through the twig.dev API",
    long_about = "Snapshot, fork and rewind running Twig pods through the twig.dev/v1alpha1 \
                  objects (Snapshot, Clone, Rollback) the Twig controller reconciles, and \
                  follow what happened (tree, wait). Reads the kubeconfig as kubectl does."
)]
pub struct Cli {
    /// Where to connect.
    #[command(flatten)]
    pub connection: Connection,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// kubectl's flags that choose the cluster and the namespace.
#[derive(Args, Debug, Clone, Default)]
#[command(next_help_heading = "Connection (as kubectl's)")]
pub struct Connection {
    /// Path to the kubeconfig file to use (default: $KUBECONFIG, else ~/.kube/config).
    #[arg(long, global = true, value_name = "PATH")]
    pub kubeconfig: Option<std::path::PathBuf>,
    /// The name of the kubeconfig context to use.
    #[arg(long, global = true, value_name = "NAME")]
    pub context: Option<String>,
    /// The name of the kubeconfig cluster to use.
    #[arg(long, global = true, value_name = "NAME")]
    pub cluster: Option<String>,
    /// The name of the kubeconfig user to use.
    #[arg(long, global = true, value_name = "NAME")]
    pub user: Option<String>,
    /// The namespace (default: the context's namespace, else `default`).
    #[arg(short, long, global = true, value_name = "NAMESPACE")]
    pub namespace: Option<String>,
}

/// The plugin's commands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Take a snapshot of a running Twig pod (creates a Snapshot).
    #[command(after_help = "Examples:\n  \
        kubectl twig snapshot redis\n  \
        kubectl twig snapshot redis --name redis-seeded --mode full --wait=2m")]
    Snapshot(SnapshotArgs),
    /// Start N copies of a running pod or of a Ready snapshot (creates a Clone).
    #[command(after_help = "Examples:\n  \
        kubectl twig fork redis --replicas 8 --wait\n  \
        kubectl twig fork --from-snapshot redis-seeded --replicas 3 --name trial")]
    Fork(ForkArgs),
    /// Rewind a running Twig pod in place to a snapshot of its lineage (creates a Rollback).
    #[command(after_help = "Example:\n  kubectl twig rewind redis --to redis-seeded --wait")]
    Rewind(RewindArgs),
    /// Show the snapshot lineage of the namespace's pods (or of one pod) as a tree.
    #[command(after_help = "Example:\n  kubectl twig tree redis")]
    Tree(TreeArgs),
    /// Wait for a condition of a Twig object (like `kubectl wait`).
    #[command(after_help = "Examples:\n  \
        kubectl twig wait snapshot/redis-seeded\n  \
        kubectl twig wait clone/trial --for=condition=Ready --timeout=5m\n  \
        kubectl twig wait rollback/redis-rewind-x --for=delete")]
    Wait(WaitArgs),
    /// Show a Twig pod's network counters: frames and bytes passed and dropped, by reason.
    #[command(after_help = "Examples:\n  \
        kubectl twig net redis\n  \
        kubectl twig net redis -n agents -o json\n\n\
        The counters come from the Twig controller on the pod's node, read through the \
        API server's pod proxy (GET pods/proxy in the controller's namespace).")]
    Net(NetArgs),
}

/// Output formats of the commands that create or wait.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// `<resource>.<group>/<name>`, one per line.
    Name,
    /// The object as JSON.
    Json,
    /// The object as YAML.
    Yaml,
}

/// `--wait[=TIMEOUT]`.
#[derive(Args, Debug, Clone)]
pub struct WaitFlag {
    /// Wait until it is done (Ready), at most TIMEOUT (a duration like 90s or 5m; 5m when
    /// no value is given). A failure while waiting is an error.
    #[arg(
        long,
        value_name = "TIMEOUT",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "5m",
        value_parser = parse_duration
    )]
    pub wait: Option<Duration>,
}

/// `kubectl twig snapshot`.
#[derive(Args, Debug)]
pub struct SnapshotArgs {
    /// The running Twig pod to snapshot.
    pub pod: String,
    /// Name of the Snapshot (default: generated, `<POD>-<suffix>`).
    #[arg(long)]
    pub name: Option<String>,
    /// What the snapshot writes: the pages changed since the pod's last snapshot, or all memory.
    #[arg(long, value_enum, default_value_t = Mode::Incremental)]
    pub mode: Mode,
    /// Delete the Snapshot this many seconds after it becomes Ready.
    #[arg(long, value_name = "SECONDS", value_parser = clap::value_parser!(i64).range(0..))]
    pub ttl: Option<i64>,
    /// Push the snapshot to the cluster's OCI registry once Ready, so that
    /// its clones run on any node (`spec.export`).
    #[arg(long)]
    pub export: bool,
    /// Waiting.
    #[command(flatten)]
    pub wait: WaitFlag,
    /// Output format (default: a line saying what was done).
    #[arg(short, long, value_enum)]
    pub output: Option<Output>,
}

/// `--mode`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Only the pages dirtied since the pod's previous snapshot.
    Incremental,
    /// All of guest memory.
    Full,
}

/// `kubectl twig fork`.
#[derive(Args, Debug)]
pub struct ForkArgs {
    /// The running Twig pod to fork (a snapshot of it is taken first).
    #[arg(
        required_unless_present = "from_snapshot",
        conflicts_with = "from_snapshot"
    )]
    pub pod: Option<String>,
    /// Fork a Ready Snapshot instead of a running pod.
    #[arg(long, value_name = "SNAPSHOT")]
    pub from_snapshot: Option<String>,
    /// How many pods to start.
    #[arg(long, value_name = "N", value_parser = parse_replicas)]
    pub replicas: i32,
    /// Name of the Clone, and the prefix of its pods' names (default: generated).
    #[arg(long)]
    pub name: Option<String>,
    /// Waiting.
    #[command(flatten)]
    pub wait: WaitFlag,
    /// Output format (default: a line saying what was done, then the pods when waiting).
    #[arg(short, long, value_enum)]
    pub output: Option<Output>,
}

fn parse_replicas(value: &str) -> Result<i32, String> {
    let n: i32 = value
        .parse()
        .map_err(|_| format!("{value:?} is not a whole number"))?;
    if n < 1 {
        return Err(format!("{n} replicas; a fork needs at least 1"));
    }
    Ok(n)
}

/// `kubectl twig rewind`.
#[derive(Args, Debug)]
pub struct RewindArgs {
    /// The running Twig pod to rewind.
    pub pod: String,
    /// The Snapshot (of the pod's lineage) to rewind to.
    #[arg(long, value_name = "SNAPSHOT")]
    pub to: String,
    /// Name of the Rollback (default: generated, `<POD>-rewind-<suffix>`).
    #[arg(long)]
    pub name: Option<String>,
    /// Do not snapshot the pod first (by default the Rollback takes a safety
    /// snapshot, so the rewind itself can be undone).
    #[arg(long)]
    pub no_safety_snapshot: bool,
    /// Waiting.
    #[command(flatten)]
    pub wait: WaitFlag,
    /// Output format (default: a line saying what was done).
    #[arg(short, long, value_enum)]
    pub output: Option<Output>,
}

/// `kubectl twig tree`.
#[derive(Args, Debug)]
pub struct TreeArgs {
    /// Only this pod's snapshots (default: every pod of the namespace).
    pub pod: Option<String>,
    /// Output format (default: the tree as a table; `name` lists the
    /// snapshots in tree order, `json`/`yaml` give the nested lineage).
    #[arg(short, long, value_enum)]
    pub output: Option<Output>,
}

/// `kubectl twig wait`.
#[derive(Args, Debug)]
pub struct WaitArgs {
    /// The object: KIND/NAME, KIND one of snapshot, clone, rollback (singular, plural,
    /// short name or with `.twig.dev`).
    #[arg(value_name = "KIND/NAME")]
    pub object: String,
    /// What to wait for: `condition=TYPE[=STATUS]` (STATUS defaults to True) or `delete`.
    #[arg(
        long = "for",
        value_name = "CONDITION",
        default_value = "condition=Ready"
    )]
    pub for_: String,
    /// How long to wait (a duration like 30s, 5m, 1h; 0 checks once).
    #[arg(long, value_parser = parse_duration, default_value = "30s")]
    pub timeout: Duration,
    /// Output format (default: `<object> condition met`).
    #[arg(short, long, value_enum)]
    pub output: Option<Output>,
}

/// Output formats of `net`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataOutput {
    /// The counters as JSON.
    Json,
    /// The counters as YAML.
    Yaml,
}

/// `kubectl twig net`.
#[derive(Args, Debug)]
pub struct NetArgs {
    /// The Twig pod whose counters to show.
    pub pod: String,
    /// The namespace the Twig controller runs in (the chart's release namespace).
    #[arg(long, value_name = "NAMESPACE", default_value = "twig-system")]
    pub controller_namespace: String,
    /// The Service of the controllers' metrics port (the chart's).
    #[arg(long, value_name = "NAME", default_value = "twig-controller")]
    pub controller_service: String,
    /// The Service's metrics port: its name or number.
    #[arg(long, value_name = "PORT", default_value = "metrics")]
    pub controller_port: String,
    /// Output format (default: a table of verdict, reason, packets, bytes).
    #[arg(short, long, value_enum)]
    pub output: Option<DataOutput>,
}
