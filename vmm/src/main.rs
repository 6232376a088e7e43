//! `twig-vmm`: serves one KVM microVM over a JSON API on a Unix socket.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use twig_vmm::api::{self, Limits, Server};
use twig_vmm::jail::{seccomp, JailArgs};
use twig_vmm::{
    console, host_connect, DeviceConfig, DiskConfig, NetConfig, Result, SerialOut, Shape, Vm,
    VsockConfig,
};

// The command line is parsed with lexopt: clap's parser and help renderer
// were 170 KB of the binary's text, resident in every VMM process (issue
// 27). The help texts below are what clap printed; the errors are worded
// as clap's were (status 2, the usage, "For more information, try
// '--help'.").

/// The start of `twig-vmm --help` and `-h`.
macro_rules! intro {
    () => {
        r#"Twig's microVM monitor. One process runs one VM: start it with `serve`,
then send JSON requests, one per line, to its socket (programs use
twig_vmm::api::Client; by hand, `socat - UNIX-CONNECT:/run/vm.sock`):
"#
    };
}

/// The commands in `twig-vmm --help` and `-h`.
macro_rules! commands {
    () => {
        r#"Usage: twig-vmm <COMMAND>

Commands:
  serve     Serve the JSON API on a Unix socket until a shutdown request
  template  Make a template: boot a kernel (and initramfs) with the given devices, wait until something in the guest accepts vsock connections on `--ready-port` (twig-agent listens on 1024), pause, and take a full snapshot into DIR. VMs restored from DIR start with the agent ready
  verify    Check a snapshot end to end (state, chain, memory checksums) and print its metadata
  help      Print this message or the help of the given subcommand(s)

"#
    };
}

/// `twig-vmm --help`.
const HELP: &str = concat!(
    intro!(),
    r#"
  {"op":"hello"}
  {"op":"boot","kernel":"vmlinux","cmdline":"console=ttyS0","mem_mib":128}
  {"op":"snapshot","dir":"/var/lib/twig/vm/tmp/<lease>/s1","kind":"full"}  (a staging dir)
  {"op":"rollback","dir":"/var/lib/twig/vm/snapshots/s1"}
  {"op":"restore","dir":"/var/lib/twig/vm/snapshots/s1"}   (in a fresh process)
  {"op":"attach_disk","slot":0,"path":"rootfs.img","read_only":false}
  {"op":"pause"} {"op":"resume"} {"op":"stats"} {"op":"shutdown"}

Answers are {"ok":{…}} or {"error":{"kind":K,"message":"…"}}, K one of
invalid_request, refused (the VM still runs on its previous state),
not_found, guest_not_answering, guest_stopped, lost (replace the VM),
busy (too many connections), internal. Connections are served
concurrently; requests on the VM run one at a time.
Needs read/write access to /dev/kvm.

"#,
    commands!(),
    r#"Options:
  -h, --help
          Print help (see a summary with '-h')

  -V, --version
          Print version
"#
);

/// `twig-vmm -h`, and on standard error without a command.
const SHORT_HELP: &str = concat!(
    intro!(),
    "\n",
    commands!(),
    r#"Options:
  -h, --help     Print help (see more with '--help')
  -V, --version  Print version
"#
);

/// `twig-vmm serve --help`: these, then [`DEVICE_FLAGS`], then the
/// jail's flags ([`JailArgs::HELP`]).
const SERVE_HELP: &str = "Serve the JSON API on a Unix socket until a shutdown request

Usage: twig-vmm serve [OPTIONS] --api-sock <API_SOCK>

Options:
      --api-sock <API_SOCK>
          Path of the API socket to create

      --serial <SERIAL>
          Where the guest's serial console goes: a file (appended) or `-` for standard output
          
          [default: -]

      --serial-max-bytes <SERIAL_MAX_BYTES>
          The most bytes the serial file holds; when full, its contents move to `<serial>.1` (replacing it) and it starts empty again
          
          [default: 4194304]

      --prepare-mem-mib <PREPARE_MEM_MIB>
          Create a VM of this many MiB ahead of time, so that a later boot or restore of that size skips VM creation

      --prepare-vcpus <PREPARE_VCPUS>
          vCPUs of the VM created ahead of time
          
          [default: 1]

      --max-connections <MAX_CONNECTIONS>
          API connections served at once; one more is refused with a `busy` error
          
          [default: 16]

      --idle-timeout-s <IDLE_TIMEOUT_S>
          Close an API connection that sends no complete request for this many seconds
          
          [default: 300]

";

/// The device flags of `serve` and `template`: flag, help, default.
const DEVICE_FLAGS: &[(&str, &str, Option<&str>)] = &[
    (
        "--disk <PATH[:ro]>",
        "A virtio-blk disk: a raw image whose size is a multiple of 512 bytes, `PATH` (read-write) or `PATH:ro`. Repeatable; the guest sees them in order (/dev/vda, /dev/vdb, …). Read-write images are copied into snapshots and replaced by the snapshot's copy on restore and rollback",
        None,
    ),
    (
        "--disk-slots <DISK_SLOTS>",
        "Empty disk slots after the disks: virtio-blk devices with no image until `attach_disk` fills one (a container's rootfs arriving after the VM runs). Snapshots restore only into VMs with as many slots",
        Some("0"),
    ),
    (
        "--slot-file <SLOT=PATH>",
        "On restore, the file that gets the snapshot's copy of an attached read-write slot (or, for a read-only slot, the same image), `SLOT=PATH`. Repeatable; every slot attached in the snapshot needs one",
        None,
    ),
    (
        "--tap <TAP>",
        "A virtio-net device on this tap (created if missing)",
        None,
    ),
    (
        "--net",
        "A virtio-net device with no tap until the API's `attach_net` sends one as a descriptor (frames the guest sends meanwhile are dropped)",
        None,
    ),
    (
        "--mac <MAC>",
        "The guest's MAC address (default: a random locally administered one)",
        None,
    ),
    (
        "--vsock-uds <VSOCK_UDS>",
        "A virtio-vsock device whose host side is this Unix socket",
        None,
    ),
    (
        "--vsock-cid <VSOCK_CID>",
        "The guest's vsock context id",
        Some("3"),
    ),
    (
        "--balloon",
        "A virtio-balloon device taking free page reports, so memory the guest frees goes back to the host (the guest kernel needs CONFIG_VIRTIO_BALLOON and CONFIG_PAGE_REPORTING). Snapshots restore only into VMs that agree on it",
        None,
    ),
];

/// `flags` as clap printed them: with `long` (`serve --help`) a default on
/// a line of its own and a blank line after each flag, else (`template
/// --help`) the default after the text.
fn flags_help(flags: &[(&str, &str, Option<&str>)], long: bool) -> String {
    flags
        .iter()
        .map(|(flag, text, default)| match (default, long) {
            (None, true) => format!("      {flag}\n          {text}\n\n"),
            (Some(d), true) => {
                format!("      {flag}\n          {text}\n          \n          [default: {d}]\n\n")
            }
            (None, false) => format!("      {flag}\n          {text}\n"),
            (Some(d), false) => format!("      {flag}\n          {text} [default: {d}]\n"),
        })
        .collect()
}

/// The end of `twig-vmm serve --help`.
const SERVE_HELP_END: &str = "  -h, --help
          Print help (see a summary with '-h')
";

/// The start of `twig-vmm template --help`: then [`DEVICE_FLAGS`] and
/// [`TEMPLATE_HELP_END`].
const TEMPLATE_HELP: &str = r#"Make a template: boot a kernel (and initramfs) with the given devices, wait until something in the guest accepts vsock connections on `--ready-port` (twig-agent listens on 1024), pause, and take a full snapshot into DIR. VMs restored from DIR start with the agent ready

Usage: twig-vmm template [OPTIONS] --kernel <KERNEL> <DIR>

Arguments:
  <DIR>  The new snapshot directory, `<store>/snapshots/<id>`: staged and published in the node store at `<store>` (created if needed)

Options:
      --kernel <KERNEL>
          The guest kernel (ELF vmlinux or bzImage)
      --initrd <INITRD>
          The initramfs (twig-agent's, from guest/build-initramfs.sh)
      --cmdline <CMDLINE>
          The kernel command line (the devices are appended) [default: "console=ttyS0 reboot=k panic=-1 loglevel=4"]
      --mem-mib <MEM_MIB>
          Guest RAM, MiB [default: 256]
      --vcpus <VCPUS>
          vCPUs [default: 1]
      --serial <SERIAL>
          Where the guest's serial console goes: a file (appended) or `-` [default: -]
      --serial-max-bytes <SERIAL_MAX_BYTES>
          The most bytes the serial file holds (as for `serve`) [default: 4194304]
      --ready-port <READY_PORT>
          The guest vsock port whose accepting connections means ready [default: 1024]
      --timeout-s <TIMEOUT_S>
          Give up when the guest is not ready after this many seconds [default: 120]
"#;

/// The end of `twig-vmm template --help`.
const TEMPLATE_HELP_END: &str = "  -h, --help\n          Print help\n";

/// `twig-vmm verify --help`.
const VERIFY_HELP: &str =
    "Check a snapshot end to end (state, chain, memory checksums) and print its metadata

Usage: twig-vmm verify <DIR>

Arguments:
  <DIR>  The snapshot directory

Options:
  -h, --help  Print help
";

const USAGE: &str = "twig-vmm <COMMAND>";
const SERVE_USAGE: &str = "twig-vmm serve [OPTIONS] --api-sock <API_SOCK>";
const TEMPLATE_USAGE: &str = "twig-vmm template [OPTIONS] --kernel <KERNEL> <DIR>";
const VERIFY_USAGE: &str = "twig-vmm verify <DIR>";

/// What the command line asks for.
enum Cmd {
    /// Serve the JSON API on a Unix socket until a shutdown request.
    Serve {
        api_sock: PathBuf,
        serial: String,
        serial_max_bytes: u64,
        prepare_mem_mib: Option<usize>,
        prepare_vcpus: usize,
        max_connections: usize,
        idle_timeout_s: u64,
        devices: DeviceArgs,
        jail: JailArgs,
    },
    /// Boot, wait for the agent, take a full snapshot into `dir`.
    Template {
        dir: PathBuf,
        kernel: PathBuf,
        initrd: Option<PathBuf>,
        cmdline: String,
        mem_mib: usize,
        vcpus: usize,
        serial: String,
        serial_max_bytes: u64,
        ready_port: u32,
        timeout_s: u64,
        devices: DeviceArgs,
    },
    /// Check a snapshot end to end and print its metadata.
    Verify { dir: PathBuf },
}

/// A command line that runs nothing: help on standard output (status 0),
/// or an error on standard error (status 2).
enum Exit {
    Print(String),
    Error(String),
}

/// An error as clap printed it.
fn error(msg: &str, usage: Option<&str>) -> Exit {
    let usage = usage.map(|u| format!("Usage: {u}\n\n")).unwrap_or_default();
    Exit::Error(format!(
        "error: {msg}\n\n{usage}For more information, try '--help'.\n"
    ))
}

/// An argument on the command line.
enum Arg {
    Short(char),
    Long(String),
    Value(std::ffi::OsString),
}

/// The error for an argument the command does not take.
fn unexpected(arg: Arg, usage: &str) -> Exit {
    let shown = match arg {
        Arg::Short(c) => format!("-{c}"),
        Arg::Long(l) => format!("--{l}"),
        Arg::Value(v) => v.to_string_lossy().into_owned(),
    };
    error(&format!("unexpected argument '{shown}' found"), Some(usage))
}

/// The parser and what it has seen of one command's flags.
struct Args {
    p: lexopt::Parser,
    usage: &'static str,
    given: Vec<&'static str>,
}

impl Args {
    /// The value of `flag` (as shown in messages: `--serial <SERIAL>`),
    /// as given: `--flag VALUE` or `--flag=VALUE`.
    fn raw(&mut self, flag: &'static str) -> std::result::Result<std::ffi::OsString, String> {
        self.p
            .value()
            .map_err(|_| format!("a value is required for '{flag}' but none was supplied"))
    }

    /// Notes `flag` given; an error if it was given before.
    fn once(&mut self, flag: &'static str) -> std::result::Result<(), Exit> {
        if self.given.contains(&flag) {
            return Err(error(
                &format!("the argument '{flag}' cannot be used multiple times"),
                Some(self.usage),
            ));
        }
        self.given.push(flag);
        Ok(())
    }

    /// The value of a flag given at most once, parsed by `parse`.
    fn value<T>(
        &mut self,
        flag: &'static str,
        parse: impl FnOnce(&str) -> std::result::Result<T, String>,
    ) -> std::result::Result<T, Exit> {
        self.once(flag)?;
        self.each(flag, parse)
    }

    /// The value of a repeatable flag, parsed by `parse`.
    fn each<T>(
        &mut self,
        flag: &'static str,
        parse: impl FnOnce(&str) -> std::result::Result<T, String>,
    ) -> std::result::Result<T, Exit> {
        let v = self.raw(flag).map_err(|e| error(&e, None))?;
        let Some(s) = v.to_str() else {
            return Err(error(
                &format!("invalid UTF-8 was detected in the value of '{flag}'"),
                None,
            ));
        };
        parse(s).map_err(|e| error(&format!("invalid value '{s}' for '{flag}': {e}"), None))
    }

    /// A path given at most once (any bytes).
    fn path(&mut self, flag: &'static str) -> std::result::Result<PathBuf, Exit> {
        self.once(flag)?;
        self.raw(flag)
            .map(PathBuf::from)
            .map_err(|e| error(&e, None))
    }

    /// A number given at most once.
    fn number<T: std::str::FromStr<Err = std::num::ParseIntError>>(
        &mut self,
        flag: &'static str,
    ) -> std::result::Result<T, Exit> {
        self.value(flag, |s| {
            s.parse()
                .map_err(|e: std::num::ParseIntError| e.to_string())
        })
    }

    /// A flag without a value given at most once.
    fn switch(&mut self, flag: &'static str) -> std::result::Result<bool, Exit> {
        self.once(flag)?;
        Ok(true)
    }

    /// The next argument; a value given to a flag that takes none is an
    /// error.
    fn next(&mut self) -> std::result::Result<Option<Arg>, Exit> {
        let usage = self.usage;
        let arg = self.p.next().map_err(|e| match e {
            lexopt::Error::UnexpectedValue { option, value } => error(
                &format!(
                    "unexpected value '{}' for '{option}' found; no more were expected",
                    value.to_string_lossy()
                ),
                Some(usage),
            ),
            e => error(&e.to_string(), Some(usage)),
        })?;
        Ok(arg.map(|arg| match arg {
            lexopt::Arg::Short(c) => Arg::Short(c),
            lexopt::Arg::Long(l) => Arg::Long(l.to_string()),
            lexopt::Arg::Value(v) => Arg::Value(v),
        }))
    }

    /// The error for flags needed and not given, none if all were.
    fn missing(&self, missing: &[&str]) -> std::result::Result<(), Exit> {
        if missing.is_empty() {
            return Ok(());
        }
        let list: String = missing.iter().map(|m| format!("\n  {m}")).collect();
        Err(error(
            &format!("the following required arguments were not provided:{list}"),
            Some(self.usage),
        ))
    }
}

/// The VM's devices beyond its serial port and entropy source.
#[derive(Default)]
struct DeviceArgs {
    /// A virtio-blk disk: a raw image whose size is a multiple of 512
    /// bytes, `PATH` (read-write) or `PATH:ro`. Repeatable; the guest
    /// sees them in order (/dev/vda, /dev/vdb, …).
    disks: Vec<DiskConfig>,
    /// Empty disk slots after the disks.
    disk_slots: usize,
    /// On restore, the file that gets the snapshot's copy of an attached
    /// slot, `SLOT=PATH`. Repeatable.
    slot_files: Vec<(usize, PathBuf)>,
    /// A virtio-net device on this tap (created if missing).
    tap: Option<String>,
    /// A virtio-net device with no tap until `attach_net` sends one.
    net: bool,
    /// The guest's MAC address (default: a random locally administered
    /// one).
    mac: Option<[u8; 6]>,
    /// A virtio-vsock device whose host side is this Unix socket.
    vsock_uds: Option<PathBuf>,
    /// The guest's vsock context id (default 3).
    vsock_cid: Option<u64>,
    /// A virtio-balloon device taking free page reports.
    balloon: bool,
}

const TAP: &str = "--tap <TAP>";
const NET: &str = "--net";

impl DeviceArgs {
    /// Takes the device flag `--<name>`; `Ok(false)` if it is not one.
    fn take(&mut self, name: &str, a: &mut Args) -> std::result::Result<bool, Exit> {
        match name {
            "disk" => self.disks.push(a.each("--disk <PATH[:ro]>", parse_disk)?),
            "disk-slots" => self.disk_slots = a.number("--disk-slots <DISK_SLOTS>")?,
            "slot-file" => self
                .slot_files
                .push(a.each("--slot-file <SLOT=PATH>", parse_slot_file)?),
            "tap" | "net" => {
                let (flag, other) = if name == "tap" {
                    (TAP, NET)
                } else {
                    (NET, TAP)
                };
                if a.given.contains(&other) {
                    return Err(error(
                        &format!("the argument '{other}' cannot be used with '{flag}'"),
                        Some(a.usage),
                    ));
                }
                if name == "tap" {
                    self.tap = Some(a.value(TAP, |s| Ok(s.to_string()))?);
                } else {
                    self.net = a.switch(NET)?;
                }
            }
            "mac" => self.mac = Some(a.value("--mac <MAC>", parse_mac)?),
            "vsock-uds" => self.vsock_uds = Some(a.path("--vsock-uds <VSOCK_UDS>")?),
            "vsock-cid" => self.vsock_cid = Some(a.number("--vsock-cid <VSOCK_CID>")?),
            "balloon" => self.balloon = a.switch("--balloon")?,
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// The flags the device flags given need and that were not given.
    fn missing(&self) -> Vec<&'static str> {
        let mut missing = Vec::new();
        if self.mac.is_some() && self.tap.is_none() && !self.net {
            missing.push("<--tap <TAP>|--net>");
        }
        if self.vsock_cid.is_some() && self.vsock_uds.is_none() {
            missing.push("--vsock-uds <VSOCK_UDS>");
        }
        missing
    }

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
                cid: self.vsock_cid.unwrap_or(3),
                uds_path,
            }),
            balloon: self.balloon,
        }
    }
}

impl Args {
    fn new(p: lexopt::Parser, usage: &'static str) -> Args {
        Args {
            p,
            usage,
            given: Vec::new(),
        }
    }

    /// Takes a jail flag (`serve`); `Ok(false)` if `name` is not one.
    fn jail(&mut self, jail: &mut JailArgs, name: &str) -> std::result::Result<bool, Exit> {
        let usage = self.usage;
        jail.take(name, &mut |flag| self.raw(flag))
            .map_err(|e| error(&e, e.contains("multiple times").then_some(usage)))
    }
}

/// The command line (see the help texts above).
fn parse(p: lexopt::Parser) -> std::result::Result<Cmd, Exit> {
    let mut a = Args::new(p, USAGE);
    let cmd = match a.next()? {
        None => return Err(Exit::Error(SHORT_HELP.into())),
        Some(Arg::Short('h')) => return Err(Exit::Print(SHORT_HELP.into())),
        Some(Arg::Long(l)) if l == "help" => return Err(Exit::Print(HELP.into())),
        Some(Arg::Short('V')) => return Err(version()),
        Some(Arg::Long(l)) if l == "version" => return Err(version()),
        Some(Arg::Value(v)) => v,
        Some(arg) => return Err(unexpected(arg, USAGE)),
    };
    let p = a.p;
    match cmd.to_str() {
        Some("serve") => parse_serve(Args::new(p, SERVE_USAGE)),
        Some("template") => parse_template(Args::new(p, TEMPLATE_USAGE)),
        Some("verify") => parse_verify(Args::new(p, VERIFY_USAGE)),
        Some("help") => {
            let mut a = Args::new(p, "twig-vmm help [COMMAND]...");
            Err(match a.next()? {
                None => Exit::Print(HELP.into()),
                Some(Arg::Value(v)) => match v.to_str() {
                    Some("serve") => Exit::Print(serve_help()),
                    Some("template") => Exit::Print(template_help()),
                    Some("verify") => Exit::Print(VERIFY_HELP.into()),
                    Some("help") => Exit::Print(HELP.into()),
                    _ => unrecognized(&v),
                },
                Some(arg) => unexpected(arg, a.usage),
            })
        }
        _ => Err(unrecognized(&cmd)),
    }
}

fn version() -> Exit {
    Exit::Print(format!("twig-vmm {}\n", env!("CARGO_PKG_VERSION")))
}

fn unrecognized(cmd: &std::ffi::OsStr) -> Exit {
    error(
        &format!("unrecognized subcommand '{}'", cmd.to_string_lossy()),
        Some(USAGE),
    )
}

fn serve_help() -> String {
    [
        SERVE_HELP,
        &flags_help(DEVICE_FLAGS, true),
        JailArgs::HELP,
        "\n",
        SERVE_HELP_END,
    ]
    .concat()
}

fn template_help() -> String {
    [
        TEMPLATE_HELP,
        &flags_help(DEVICE_FLAGS, false),
        TEMPLATE_HELP_END,
    ]
    .concat()
}

fn parse_serve(mut a: Args) -> std::result::Result<Cmd, Exit> {
    let mut api_sock = None;
    let mut serial = None;
    let mut serial_max_bytes = None;
    let mut prepare_mem_mib = None;
    let mut prepare_vcpus = None;
    let mut max_connections = None;
    let mut idle_timeout_s = None;
    let mut devices = DeviceArgs::default();
    let mut jail = JailArgs::default();
    while let Some(arg) = a.next()? {
        let name = match arg {
            Arg::Long(l) => l,
            Arg::Short('h') => return Err(Exit::Print(serve_help())),
            arg => return Err(unexpected(arg, a.usage)),
        };
        match name.as_str() {
            "help" => return Err(Exit::Print(serve_help())),
            "api-sock" => api_sock = Some(a.path("--api-sock <API_SOCK>")?),
            "serial" => serial = Some(a.value("--serial <SERIAL>", |s| Ok(s.to_string()))?),
            "serial-max-bytes" => {
                serial_max_bytes = Some(a.number("--serial-max-bytes <SERIAL_MAX_BYTES>")?)
            }
            "prepare-mem-mib" => {
                prepare_mem_mib = Some(a.number("--prepare-mem-mib <PREPARE_MEM_MIB>")?)
            }
            "prepare-vcpus" => prepare_vcpus = Some(a.number("--prepare-vcpus <PREPARE_VCPUS>")?),
            "max-connections" => {
                max_connections = Some(a.number("--max-connections <MAX_CONNECTIONS>")?)
            }
            "idle-timeout-s" => {
                idle_timeout_s = Some(a.number("--idle-timeout-s <IDLE_TIMEOUT_S>")?)
            }
            other => {
                if !devices.take(other, &mut a)? && !a.jail(&mut jail, other)? {
                    return Err(unexpected(Arg::Long(name), a.usage));
                }
            }
        }
    }
    let mut missing = Vec::new();
    if api_sock.is_none() {
        missing.push("--api-sock <API_SOCK>");
    }
    missing.extend(devices.missing());
    missing.extend(jail.missing());
    a.missing(&missing)?;
    Ok(Cmd::Serve {
        api_sock: api_sock.unwrap_or_default(),
        serial: serial.unwrap_or_else(|| "-".into()),
        serial_max_bytes: serial_max_bytes.unwrap_or(SERIAL_MAX_BYTES),
        prepare_mem_mib,
        prepare_vcpus: prepare_vcpus.unwrap_or(1),
        max_connections: max_connections.unwrap_or(16),
        idle_timeout_s: idle_timeout_s.unwrap_or(300),
        devices,
        jail,
    })
}

fn parse_template(mut a: Args) -> std::result::Result<Cmd, Exit> {
    let mut dir = None;
    let mut kernel = None;
    let mut initrd = None;
    let mut cmdline = None;
    let mut mem_mib = None;
    let mut vcpus = None;
    let mut serial = None;
    let mut serial_max_bytes = None;
    let mut ready_port = None;
    let mut timeout_s = None;
    let mut devices = DeviceArgs::default();
    while let Some(arg) = a.next()? {
        let name = match arg {
            Arg::Long(l) => l,
            Arg::Short('h') => return Err(Exit::Print(template_help())),
            Arg::Value(v) if dir.is_none() => {
                dir = Some(PathBuf::from(v));
                continue;
            }
            arg => return Err(unexpected(arg, a.usage)),
        };
        match name.as_str() {
            "help" => return Err(Exit::Print(template_help())),
            "kernel" => kernel = Some(a.path("--kernel <KERNEL>")?),
            "initrd" => initrd = Some(a.path("--initrd <INITRD>")?),
            "cmdline" => cmdline = Some(a.value("--cmdline <CMDLINE>", |s| Ok(s.to_string()))?),
            "mem-mib" => mem_mib = Some(a.number("--mem-mib <MEM_MIB>")?),
            "vcpus" => vcpus = Some(a.number("--vcpus <VCPUS>")?),
            "serial" => serial = Some(a.value("--serial <SERIAL>", |s| Ok(s.to_string()))?),
            "serial-max-bytes" => {
                serial_max_bytes = Some(a.number("--serial-max-bytes <SERIAL_MAX_BYTES>")?)
            }
            "ready-port" => ready_port = Some(a.number("--ready-port <READY_PORT>")?),
            "timeout-s" => timeout_s = Some(a.number("--timeout-s <TIMEOUT_S>")?),
            other => {
                if !devices.take(other, &mut a)? {
                    return Err(unexpected(Arg::Long(name), a.usage));
                }
            }
        }
    }
    let mut missing = Vec::new();
    if kernel.is_none() {
        missing.push("--kernel <KERNEL>");
    }
    if dir.is_none() {
        missing.push("<DIR>");
    }
    missing.extend(devices.missing());
    a.missing(&missing)?;
    Ok(Cmd::Template {
        dir: dir.unwrap_or_default(),
        kernel: kernel.unwrap_or_default(),
        initrd,
        cmdline: cmdline.unwrap_or_else(|| "console=ttyS0 reboot=k panic=-1 loglevel=4".into()),
        mem_mib: mem_mib.unwrap_or(256),
        vcpus: vcpus.unwrap_or(1),
        serial: serial.unwrap_or_else(|| "-".into()),
        serial_max_bytes: serial_max_bytes.unwrap_or(SERIAL_MAX_BYTES),
        ready_port: ready_port.unwrap_or(1024),
        timeout_s: timeout_s.unwrap_or(120),
        devices,
    })
}

fn parse_verify(mut a: Args) -> std::result::Result<Cmd, Exit> {
    let mut dir = None;
    while let Some(arg) = a.next()? {
        match arg {
            Arg::Short('h') => return Err(Exit::Print(VERIFY_HELP.into())),
            Arg::Long(l) if l == "help" => return Err(Exit::Print(VERIFY_HELP.into())),
            Arg::Value(v) if dir.is_none() => dir = Some(PathBuf::from(v)),
            arg => return Err(unexpected(arg, a.usage)),
        }
    }
    a.missing(if dir.is_none() { &["<DIR>"] } else { &[] })?;
    Ok(Cmd::Verify {
        dir: dir.unwrap_or_default(),
    })
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

fn run(cmd: Cmd) -> Result<()> {
    match cmd {
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

/// The VMM's log: `tracing_subscriber::fmt`'s, built at the first event
/// or span. Its registry fills a table of 4,096 shard pointers (32 KiB of
/// heap) when built, and a healthy VMM logs nothing at the default level,
/// so most never build it (issue 27).
struct LazyLog {
    level: tracing::Level,
    log: twig_vmm::logcap::Capped<Stderr>,
    fmt: std::sync::OnceLock<Box<dyn tracing::Subscriber + Send + Sync>>,
}

impl LazyLog {
    fn fmt(&self) -> &(dyn tracing::Subscriber + Send + Sync) {
        &**self.fmt.get_or_init(|| {
            let log = self.log.make();
            Box::new(
                tracing_subscriber::fmt()
                    .with_max_level(self.level)
                    .with_writer(move || log.make())
                    .finish(),
            )
        })
    }
}

impl tracing::Subscriber for LazyLog {
    fn enabled(&self, meta: &tracing::Metadata<'_>) -> bool {
        *meta.level() <= self.level
    }
    fn max_level_hint(&self) -> Option<tracing::level_filters::LevelFilter> {
        Some(self.level.into())
    }
    fn new_span(&self, span: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        self.fmt().new_span(span)
    }
    fn record(&self, span: &tracing::span::Id, values: &tracing::span::Record<'_>) {
        self.fmt().record(span, values)
    }
    fn record_follows_from(&self, span: &tracing::span::Id, follows: &tracing::span::Id) {
        self.fmt().record_follows_from(span, follows)
    }
    fn event(&self, event: &tracing::Event<'_>) {
        self.fmt().event(event)
    }
    fn enter(&self, span: &tracing::span::Id) {
        self.fmt().enter(span)
    }
    fn exit(&self, span: &tracing::span::Id) {
        self.fmt().exit(span)
    }
    fn clone_span(&self, id: &tracing::span::Id) -> tracing::span::Id {
        self.fmt().clone_span(id)
    }
    fn try_close(&self, id: tracing::span::Id) -> bool {
        self.fmt().try_close(id)
    }
}

fn main() -> ExitCode {
    let cmd = match parse(lexopt::Parser::from_env()) {
        Ok(cmd) => cmd,
        Err(Exit::Print(text)) => {
            print!("{text}");
            return ExitCode::SUCCESS;
        }
        Err(Exit::Error(text)) => {
            eprint!("{text}");
            return ExitCode::from(2);
        }
    };
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
    tracing_subscriber::util::SubscriberInitExt::init(LazyLog {
        level,
        log,
        fmt: std::sync::OnceLock::new(),
    });
    match run(cmd) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("twig-vmm: {e}");
            ExitCode::FAILURE
        }
    }
}
