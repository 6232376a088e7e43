//! `twig-vmm`: serves one KVM microVM over a JSON API on a Unix socket.

use std::fs::OpenOptions;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use twig_vmm::api::{self, Server};
use twig_vmm::{Result, SerialOut, Shape};

/// Twig's microVM monitor. One process runs one VM: start it with `serve`,
/// then send JSON requests, one per line, to its socket, e.g. with
/// `socat - UNIX-CONNECT:/run/vm.sock`:
///
///   {"op":"boot","kernel":"vmlinux","cmdline":"console=ttyS0","mem_mib":128}
///   {"op":"snapshot","dir":"/var/lib/twig/s1","kind":"full"}
///   {"op":"rollback","dir":"/var/lib/twig/s1"}
///   {"op":"restore","dir":"/var/lib/twig/s1"}   (in a fresh process)
///   {"op":"pause"} {"op":"resume"} {"op":"stats"} {"op":"shutdown"}
///
/// Answers are {"ok":true,"result":…} or {"ok":false,"error":"…"}.
/// Needs read/write access to /dev/kvm.
#[derive(Parser)]
#[command(name = "twig-vmm", version, verbatim_doc_comment)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve the JSON API on a Unix socket until a shutdown request.
    Serve {
        /// Path of the API socket to create.
        #[arg(long)]
        api_sock: PathBuf,
        /// Where the guest's serial console goes: a file (appended) or `-`
        /// for standard output.
        #[arg(long, default_value = "-")]
        serial: String,
        /// Create a VM of this many MiB ahead of time, so that a later boot
        /// or restore of that size skips VM creation.
        #[arg(long)]
        prepare_mem_mib: Option<usize>,
        /// vCPUs of the VM created ahead of time.
        #[arg(long, default_value_t = 1)]
        prepare_vcpus: usize,
    },
    /// Check a snapshot end to end (state, chain, memory checksums) and print
    /// its metadata.
    Verify {
        /// The snapshot directory.
        dir: PathBuf,
    },
}

fn serial_factory(spec: String) -> api::SerialFactory {
    Box::new(move || -> Result<SerialOut> {
        if spec == "-" {
            return Ok(Box::new(std::io::stdout()));
        }
        let f = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&spec)
            .map_err(|e| twig_vmm::Error::io(format!("opening serial output {spec}"), e))?;
        Ok(Box::new(f))
    })
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Cmd::Serve {
            api_sock,
            serial,
            prepare_mem_mib,
            prepare_vcpus,
        } => {
            let prepare = prepare_mem_mib.map(|m| Shape::new(m, prepare_vcpus));
            let mut server = Server::new(serial_factory(serial), prepare)?;
            let listener = api::bind(&api_sock)?;
            let result = server.serve(&listener);
            let _ = std::fs::remove_file(&api_sock);
            result
        }
        Cmd::Verify { dir } => {
            let meta = twig_vmm::snapshot::verify(&dir)?;
            println!(
                "{}",
                serde_json::to_string_pretty(&meta).unwrap_or_default()
            );
            Ok(())
        }
    }
}

fn main() -> ExitCode {
    // A plain level (TWIG_LOG=error|warn|info|debug|trace), not an
    // EnvFilter: its regex engine would add to every VMM process's memory.
    let level = std::env::var("TWIG_LOG")
        .ok()
        .and_then(|l| l.parse::<tracing::Level>().ok())
        .unwrap_or(tracing::Level::WARN);
    tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(std::io::stderr)
        .init();
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("twig-vmm: {e}");
            ExitCode::FAILURE
        }
    }
}
