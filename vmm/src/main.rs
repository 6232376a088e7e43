//! `twig-vmm`: serves one KVM microVM over a JSON API on a Unix socket.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use twig_vmm::api::{self, Limits, Server};
use twig_vmm::jail::{seccomp, JailArgs};
use twig_vmm::{
    console, host_connect, DeviceConfig, DiskConfig, NetConfig, Result, SerialOut, Shape, Vm,
    VsockConfig,
};

/// Twig's microVM monitor. One process runs one VM: start it with `serve`,
/// then send JSON requests, one per line, to its socket (programs use
/// twig_vmm::api::Client; by hand, `socat - UNIX-CONNECT:/run/vm.sock`):
///
///   {"op":"hello"}
///   {"op":"boot","kernel":"vmlinux","cmdline":"console=ttyS0","mem_mib":128}
///   {"op":"snapshot","dir":"/var/lib/twig/vm/tmp/<lease>/s1","kind":"full"}  (a staging dir)
///   {"op":"rollback","dir":"/var/lib/twig/vm/snapshots/s1"}
///   {"op":"restore","dir":"/var/lib/twig/vm/snapshots/s1"}   (in a fresh process)
///   {"op":"attach_disk","slot":0,"path":"rootfs.img","read_only":false}
///   {"op":"pause"} {"op":"resume"} {"op":"stats"} {"op":"shutdown"}
///
/// Answers are {"ok":{…}} or {"error":{"kind":K,"message":"…"}}, K one of
/// invalid_request, refused (the VM still runs on its previous state),
/// not_found, guest_not_answering, guest_stopped, lost (replace the VM),
/// busy (too many connections), internal. Connections are served
/// concurrently; requests on the VM run one at a time.
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
        /// The most bytes the serial file holds; when full, its contents
        /// move to `<serial>.1` (replacing it) and it starts empty again.
        #[arg(long, default_value_t = SERIAL_MAX_BYTES)]
        serial_max_bytes: u64,
        /// Create a VM of this many MiB ahead of time, so that a later boot
        /// or restore of that size skips VM creation.
        #[arg(long)]
        prepare_mem_mib: Option<usize>,
        /// vCPUs of the VM created ahead of time.
        #[arg(long, default_value_t = 1)]
        prepare_vcpus: usize,
        /// API connections served at once; one more is refused with a
        /// `busy` error.
        #[arg(long, default_value_t = 16)]
        max_connections: usize,
        /// Close an API connection that sends no complete request for this
        /// many seconds.
        #[arg(long, default_value_t = 300)]
        idle_timeout_s: u64,
        #[command(flatten)]
        devices: DeviceArgs,
        #[command(flatten)]
        jail: JailArgs,
    },
    /// Make a template: boot a kernel (and initramfs) with the given devices,
    /// wait until something in the guest accepts vsock connections on
    /// `--ready-port` (twig-agent listens on 1024), pause, and take a full
    /// snapshot into DIR. VMs restored from DIR start with the agent ready.
    Template {
        /// The new snapshot directory, `<store>/snapshots/<id>`: staged and
        /// published in the node store at `<store>` (created if needed).
        dir: PathBuf,
        /// The guest kernel (ELF vmlinux or bzImage).
        #[arg(long)]
        kernel: PathBuf,
        /// The initramfs (twig-agent's, from guest/build-initramfs.sh).
        #[arg(long)]
        initrd: Option<PathBuf>,
        /// The kernel command line (the devices are appended).
        #[arg(long, default_value = "console=ttyS0 reboot=k panic=-1 loglevel=4")]
        cmdline: String,
        /// Guest RAM, MiB.
        #[arg(long, default_value_t = 256)]
        mem_mib: usize,
        /// vCPUs.
        #[arg(long, default_value_t = 1)]
        vcpus: usize,
        /// Where the guest's serial console goes: a file (appended) or `-`.
        #[arg(long, default_value = "-")]
        serial: String,
        /// The most bytes the serial file holds (as for `serve`).
        #[arg(long, default_value_t = SERIAL_MAX_BYTES)]
        serial_max_bytes: u64,
        /// The guest vsock port whose accepting connections means ready.
        #[arg(long, default_value_t = 1024)]
        ready_port: u32,
        /// Give up when the guest is not ready after this many seconds.
        #[arg(long, default_value_t = 120)]
        timeout_s: u64,
        #[command(flatten)]
        devices: DeviceArgs,
    },
    /// Check a snapshot end to end (state, chain, memory checksums) and print
    /// its metadata.
    Verify {
        /// The snapshot directory.
        dir: PathBuf,
    },
}

/// The VM's devices beyond its serial port and entropy source.
#[derive(clap::Args)]
struct DeviceArgs {
    /// A virtio-blk disk: a raw image whose size is a multiple of 512
    /// bytes, `PATH` (read-write) or `PATH:ro`. Repeatable; the guest
    /// sees them in order (/dev/vda, /dev/vdb, …). Read-write images are
    /// copied into snapshots and replaced by the snapshot's copy on
    /// restore and rollback.
    #[arg(long = "disk", value_name = "PATH[:ro]", value_parser = parse_disk)]
    disks: Vec<DiskConfig>,
    /// Empty disk slots after the disks: virtio-blk devices with no image
    /// until `attach_disk` fills one (a container's rootfs arriving after
    /// the VM runs). Snapshots restore only into VMs with as many slots.
    #[arg(long, default_value_t = 0)]
    disk_slots: usize,
    /// On restore, the file that gets the snapshot's copy of an attached
    /// read-write slot (or, for a read-only slot, the same image),
    /// `SLOT=PATH`. Repeatable; every slot attached in the snapshot needs one.
    #[arg(long = "slot-file", value_name = "SLOT=PATH", value_parser = parse_slot_file)]
    slot_files: Vec<(usize, PathBuf)>,
    /// A virtio-net device on this tap (created if missing).
    #[arg(long, group = "net_device")]
    tap: Option<String>,
    /// A virtio-net device with no tap until the API's `attach_net` sends
    /// one as a descriptor (frames the guest sends meanwhile are dropped).
    #[arg(long, group = "net_device")]
    net: bool,
    /// The guest's MAC address (default: a random locally administered
    /// one).
    #[arg(long, value_parser = parse_mac, requires = "net_device")]
    mac: Option<[u8; 6]>,
    /// A virtio-vsock device whose host side is this Unix socket.
    #[arg(long)]
    vsock_uds: Option<PathBuf>,
    /// The guest's vsock context id.
    #[arg(long, default_value_t = 3, requires = "vsock_uds")]
    vsock_cid: u64,
    /// A virtio-balloon device taking free page reports, so memory the guest
    /// frees goes back to the host (the guest kernel needs
    /// CONFIG_VIRTIO_BALLOON and CONFIG_PAGE_REPORTING). Snapshots restore
    /// only into VMs that agree on it.
    #[arg(long)]
    balloon: bool,
}

impl DeviceArgs {
    fn config(self) -> DeviceConfig {
        DeviceConfig {
            disks: self.disks,
            disk_slots: self.disk_slots,
            slot_files: self.slot_files.into_iter().collect(),
            net: (self.net || self.tap.is_some()).then(|| NetConfig {
                tap: self.tap,
                mac: self.mac.unwrap_or_else(random_mac),
            }),
            vsock: self.vsock_uds.map(|uds_path| VsockConfig {
                cid: self.vsock_cid,
                uds_path,
            }),
            balloon: self.balloon,
        }
    }
}

fn parse_slot_file(s: &str) -> std::result::Result<(usize, PathBuf), String> {
    let (slot, path) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not SLOT=PATH"))?;
    let slot = slot
        .parse()
        .map_err(|_| format!("{slot:?} is not a slot number"))?;
    if path.is_empty() {
        return Err("the slot's file path is empty".into());
    }
    Ok((slot, PathBuf::from(path)))
}

fn parse_disk(s: &str) -> std::result::Result<DiskConfig, String> {
    let (path, read_only) = match s.rsplit_once(':') {
        Some((p, "ro")) => (p, true),
        Some((p, "rw")) => (p, false),
        _ => (s, false),
    };
    if path.is_empty() {
        return Err("the disk path is empty".into());
    }
    Ok(DiskConfig {
        path: PathBuf::from(path),
        read_only,
    })
}

fn parse_mac(s: &str) -> std::result::Result<[u8; 6], String> {
    let parts: Vec<&str> = s.split(':').collect();
    let mut mac = [0u8; 6];
    if parts.len() != 6 {
        return Err(format!("{s:?} is not a MAC address like aa:bb:cc:dd:ee:ff"));
    }
    for (b, p) in mac.iter_mut().zip(parts) {
        *b = u8::from_str_radix(p, 16)
            .ok()
            .filter(|_| p.len() == 2)
            .ok_or_else(|| format!("{s:?} is not a MAC address like aa:bb:cc:dd:ee:ff"))?;
    }
    if mac[0] & 1 != 0 {
        return Err(format!("{s:?} is a multicast address"));
    }
    Ok(mac)
}

/// A random, locally administered, unicast MAC address.
fn random_mac() -> [u8; 6] {
    let mut mac = [0u8; 6];
    // SAFETY: getrandom writes at most mac.len() bytes into mac.
    let n = unsafe { libc::getrandom(mac.as_mut_ptr().cast(), mac.len(), 0) };
    if n != mac.len() as isize {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
            ^ u128::from(std::process::id());
        mac.copy_from_slice(&t.to_le_bytes()[..6]);
    }
    mac[0] = (mac[0] & 0xfe) | 0x02;
    mac
}

/// The default bound of the serial file (and of its previous part).
const SERIAL_MAX_BYTES: u64 = 4 << 20;

fn serial_factory(spec: String, max_bytes: u64) -> api::SerialFactory {
    Box::new(move || -> Result<SerialOut> {
        if spec == "-" {
            return Ok(Box::new(std::io::stdout()));
        }
        console::open(Path::new(&spec), max_bytes)
    })
}

fn jail_error(e: twig_vmm::jail::JailError) -> twig_vmm::Error {
    twig_vmm::Error::Config(format!("confining the VMM: {e}"))
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Cmd::Serve {
            api_sock,
            serial,
            serial_max_bytes,
            prepare_mem_mib,
            prepare_vcpus,
            max_connections,
            idle_timeout_s,
            devices,
            jail,
        } => {
            jail.apply(devices.tap.is_some()).map_err(jail_error)?;
            // From here on the main thread and the threads it spawns (the
            // one preparing the VM, the API connections) are filtered: the
            // API filter allows what is left to open (the serial file, the
            // API socket).
            seccomp::confine(seccomp::Role::Api).map_err(jail_error)?;
            let prepare = prepare_mem_mib.map(|m| Shape::new(m, prepare_vcpus));
            let devices = devices.config();
            let limits = Limits {
                max_connections,
                idle_timeout: Duration::from_secs(idle_timeout_s),
            };
            let server = Server::new(
                serial_factory(serial, serial_max_bytes),
                prepare,
                devices,
                limits,
            )?;
            let listener = api::bind(&api_sock)?;
            let result = server.serve(&listener);
            let _ = std::fs::remove_file(&api_sock);
            result
        }
        Cmd::Template {
            dir,
            kernel,
            initrd,
            cmdline,
            mem_mib,
            vcpus,
            serial,
            serial_max_bytes,
            ready_port,
            timeout_s,
            devices,
        } => {
            let (root, id) = twig_store::layout::locate(&dir)?;
            let devices = devices.config();
            let Some(vsock) = devices.vsock.clone() else {
                return Err(twig_vmm::Error::Config(
                    "a template needs --vsock-uds: readiness is a vsock connection".into(),
                ));
            };
            let serial = serial_factory(serial, serial_max_bytes)()?;
            let mut vm = Vm::create_with(Shape::new(mem_mib, vcpus), serial, &devices)?;
            vm.boot_linux(&kernel, initrd.as_deref(), &cmdline)?;
            let store = twig_store::NodeStore::open(&root, true)?;
            let staging = store.stage(&id)?;
            let probe = Duration::from_secs(2);
            let info = vm.template(staging.dir(), Duration::from_secs(timeout_s), || {
                host_connect(&vsock.uds_path, ready_port, probe).is_ok()
            })?;
            staging.publish()?;
            println!(
                "{}",
                serde_json::to_string_pretty(&info).unwrap_or_default()
            );
            Ok(())
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

/// The process's stderr, as a cloneable writer.
#[derive(Clone, Copy)]
struct Stderr;

impl std::io::Write for Stderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        std::io::stderr().write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

/// The command line, parsed on a short-lived thread: clap's parser touches
/// about 100 KiB of stack, which on the main thread would stay resident for
/// the VMM's whole life; glibc gives an exited thread's stack pages back.
fn parse_args() -> Cli {
    std::thread::Builder::new()
        .name("twig-args".into())
        .spawn(Cli::parse)
        .map_or_else(
            |_| Cli::parse(),
            |t| t.join().unwrap_or_else(|_| std::process::exit(2)),
        )
}

fn main() -> ExitCode {
    // One malloc arena for every thread: a VMM's threads allocate little,
    // and an arena per thread costs each of them resident pages of its own.
    // SAFETY: mallopt only sets an allocator parameter; no allocation is
    // in flight (no other thread exists yet).
    #[cfg(target_env = "gnu")]
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
    // A plain level (TWIG_LOG=error|warn|info|debug|trace), not an
    // EnvFilter: its regex engine would add to every VMM process's memory.
    let level = std::env::var("TWIG_LOG")
        .ok()
        .and_then(|l| l.parse::<tracing::Level>().ok())
        .unwrap_or(tracing::Level::WARN);
    // Bounded: a guest must not be able to fill the node's disk through
    // the VMM's log (twig-node's `vmm.log`).
    let max = std::env::var("TWIG_LOG_MAX_BYTES")
        .ok()
        .and_then(|m| m.parse().ok())
        .unwrap_or(twig_vmm::logcap::DEFAULT_MAX_BYTES);
    let log = twig_vmm::logcap::Capped::new(Stderr, max);
    tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(move || log.make())
        .init();
    match run(parse_args()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("twig-vmm: {e}");
            ExitCode::FAILURE
        }
    }
}
