//! `twig-bench`: Twig's benchmarks. Each subcommand prints a human table to
//! stderr and, with `--json`, one JSON object to stdout.

mod cri;
mod demo;
mod firecracker;
mod linux;
mod loop_xfs;
mod net;
mod node;
mod objects;
mod oci;
mod shared_dir;
mod shim;
mod snapshotter;
mod stats;
mod vmm;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "twig-bench", about = "Benchmarks for Twig's components")]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Print one JSON object with every measurement to stdout.
    #[arg(long, global = true)]
    json: bool,
}

#[derive(Subcommand)]
enum Command {
    /// twig-vmm: boot, snapshot, restore, clone and rollback of test guests on /dev/kvm.
    Vmm(vmm::Args),
    /// twig-snapshotter: reflink versus copy, concurrent Prepares, shared blocks.
    Snapshotter(snapshotter::Args),
    /// Linux guests with twig-agent (in the nested lab: tests/lab/run.sh --bench):
    /// boot versus template restore to agent ready; snapshot, rollback and clone
    /// with a 64 MiB working set.
    Linux(linux::Args),
    /// twig-net: eBPF redirect versus bridge and tc mirred (pps, latency), path set-up time.
    Net(net::Args),
    /// twig-node: a pod's VM acquisition + template restore, from the warm pool
    /// versus spawned on demand (real twig-node and twig-vmm processes).
    Node(node::Args),
    /// The real path end to end, in the nested lab (tests/lab/run.sh --demo): a
    /// pod from the template through CRI, exec, snapshot, rollback, clone, timed.
    Demo(demo::Args),
    /// Pod start through containerd's CRI plugin (RunPodSandbox + CreateContainer +
    /// StartContainer → first output) at concurrency 1 and 8, per runtime handler.
    Cri(cri::Args),
    /// Snapshot, Rollback and Clone ×N through the Kubernetes objects against their
    /// cost at the shim (in the nested lab: tests/lab/run.sh --bench objects).
    Objects(objects::Args),
    /// The shim's own time per pod (Task calls minus the waits on the sandbox),
    /// on the host's CPUs: containerd's calls over ttrpc against twig-agent on the host.
    Shim(shim::Args),
    /// twig-vmm and Firecracker side by side on the same guest, runs
    /// alternating (needs a Firecracker binary: scripts/build-firecracker.sh).
    Fc(firecracker::Args),
    /// Snapshots across nodes through an OCI registry: bytes and times of
    /// push and pull, full and incremental, restore of a pulled snapshot
    /// against a local one, per guest size.
    Oci(oci::Args),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Vmm(args) => vmm::run(&args),
        Command::Snapshotter(args) => snapshotter::run(&args),
        Command::Linux(args) => linux::run(&args),
        Command::Net(args) => net::run(&args),
        Command::Cri(args) => cri::run(&args),
        Command::Demo(args) => demo::run(&args),
        Command::Node(args) => node::run(&args),
        Command::Shim(args) => shim::run(&args),
        Command::Objects(args) => objects::run(&args),
        Command::Fc(args) => firecracker::run(&args),
        Command::Oci(args) => oci::run(&args),
    };
    match result {
        Ok(value) => {
            if cli.json {
                println!("{value}");
            }
        }
        Err(e) => {
            eprintln!("twig-bench: {e}");
            std::process::exit(1);
        }
    }
}
