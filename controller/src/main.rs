//! `twig-controller run`: the per-node controller (DaemonSet).
//! `twig-controller crds`: prints or writes the CRD YAML.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand};
use twig_controller::metrics::Metrics;
use twig_controller::sandbox::ContainerdLocator;
use twig_controller::shim::{TtrpcNode, TtrpcShim};
use twig_controller::{crd, Context};

#[derive(Parser)]
#[command(
    version,
    about = "Twig's per-node controller for Snapshot, Clone, Rollback and SandboxTemplate"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Reconcile the Twig objects of this node.
    Run {
        /// This node's name (DaemonSet: from the downward API, spec.nodeName).
        #[arg(long, env = "NODE_NAME")]
        node_name: String,
        /// Address of the Prometheus metrics endpoint.
        #[arg(long, default_value = "0.0.0.0:9090")]
        metrics_addr: SocketAddr,
        /// containerd's runtime v2 task directory of the Kubernetes namespace.
        #[arg(
            long,
            default_value = "/run/containerd/io.containerd.runtime.v2.task/k8s.io"
        )]
        containerd_tasks: PathBuf,
        /// ttrpc address of the node service (node store and templates).
        #[arg(long, default_value = "unix:///run/twig/node.sock")]
        node_socket: String,
        /// Deadline of one call to a shim or the node service, in seconds.
        #[arg(long, default_value_t = 120)]
        call_timeout_secs: u64,
        /// The OCI registry (`host[:port]`) Snapshots with `spec.export` are
        /// pushed to; none: such Snapshots say `NoRegistry`.
        #[arg(long)]
        registry: Option<String>,
        /// The first path component(s) of every snapshot repository
        /// (`<registry>/<prefix>/<namespace>/<name>`); must equal the nodes'
        /// `registry.repository_prefix`.
        #[arg(long, default_value = "twig")]
        registry_prefix: String,
    },
    /// Write the CRD YAML files (one per CRD) into a directory, or print them.
    Crds {
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let spec = std::env::var("RUST_LOG").ok();
    tracing_subscriber::fmt()
        .with_env_filter(twig_controller::log_filter(spec.as_deref()))
        .init();
    match Cli::parse().command {
        Command::Crds { out } => {
            for (file, yaml) in crd::crd_files()? {
                match &out {
                    Some(dir) => {
                        let path = dir.join(&file);
                        std::fs::write(&path, yaml)
                            .map_err(|e| format!("writing {}: {e}", path.display()))?;
                    }
                    None => print!("---\n{yaml}"),
                }
            }
            Ok(())
        }
        Command::Run {
            node_name,
            metrics_addr,
            containerd_tasks,
            node_socket,
            call_timeout_secs,
            registry,
            registry_prefix,
        } => {
            let registry = registry
                .map(|host| twig_controller::context::Registry::new(&host, &registry_prefix))
                .transpose()
                .map_err(|e| format!("--registry/--registry-prefix: {e}"))?;
            let client = kube::Client::try_default()
                .await
                .map_err(|e| format!("connecting to the Kubernetes API: {e}"))?;
            let timeout = Duration::from_secs(call_timeout_secs);
            let metrics = Arc::new(Metrics::new());
            let listener = tokio::net::TcpListener::bind(metrics_addr)
                .await
                .map_err(|e| format!("binding the metrics address {metrics_addr}: {e}"))?;
            let mut ctx = Context::new(
                client,
                node_name.clone(),
                Arc::new(ContainerdLocator::new(containerd_tasks)),
                Arc::new(TtrpcShim { timeout }),
                Arc::new(TtrpcNode {
                    address: node_socket,
                    timeout,
                }),
                metrics.clone(),
            );
            if let Some(registry) = registry {
                ctx = ctx.with_registry(registry);
            }
            let ctx = Arc::new(ctx);
            tracing::info!(node = %node_name, %metrics_addr, registry = ?ctx.registry, "twig-controller starting");
            let mut sigterm =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
            tokio::select! {
                () = twig_controller::run(ctx) => {}
                () = twig_controller::metrics::serve(listener, metrics) => {}
                _ = tokio::signal::ctrl_c() => tracing::info!("interrupted; stopping"),
                _ = sigterm.recv() => tracing::info!("terminated; stopping"),
            }
            Ok(())
        }
    }
}
