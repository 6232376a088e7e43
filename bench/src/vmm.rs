//! Benchmarks of twig-vmm on the ring-3 test guest: boot, full and
//! incremental snapshots, restore, N-way clones, in-place rollback, VMM
//! memory per VM and how many VMs run at once.
//!
//! Every timing ends when the guest shows it runs (a byte on its serial
//! port), not when the API call returns, except snapshots (the call) and
//! rollback (the call, which resumes the vCPU before returning).

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};
use twig_store::NodeStore;
use twig_vmm::api::Client;
use twig_vmm::snapshot::Image;
use twig_vmm::testguest::{self, Command};
use twig_vmm::{Capture, DeviceConfig, Kind, RunState, Shape, Vm};

use crate::stats::{row, Context, Error, Report, Summary};

mod snapshots;

use crate::loop_xfs::LoopXfs;

/// Deadline of every wait on a guest or a twig-vmm process.
const T: Duration = Duration::from_secs(20);
/// Page counts of the incremental snapshot and rollback measurements.
const PAGE_COUNTS: [u64; 3] = [100, 1000, 10_000];
const PAGE: u64 = 4096;

#[derive(clap::Args)]
pub struct Args {
    /// Timed runs of each measurement.
    #[arg(long, default_value_t = 50)]
    runs: usize,
    /// Timed runs of the 64-way clone (each starts 64 VMs).
    #[arg(long, default_value_t = 10)]
    clone64_runs: usize,
    /// Guest RAM of every VM, MiB (at least 56: the benchmark dirties 10,000
    /// pages above the guest's 16 MiB scratch start).
    #[arg(long, default_value_t = 128)]
    mem_mib: usize,
    /// Stop the density test after this many running VMs.
    #[arg(long, default_value_t = 1000)]
    max_vms_cap: usize,
    /// twig-vmm processes started for the VMM RSS measurement.
    #[arg(long, default_value_t = 20)]
    rss_vms: usize,
    /// Measure VMM RSS and max_vms with VMs in this process even when the
    /// twig-vmm binary is found next to this one.
    #[arg(long)]
    in_process: bool,
    /// Directory under which a temporary snapshot directory is made.
    #[arg(long, default_value = "/tmp")]
    dir: PathBuf,
    /// `--seccomp` of the twig-vmm processes started (`off` measures the
    /// VMM without its filters, for a before/after).
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    vmm_seccomp: String,
    /// Only measure rollback with a read-write disk attached (by path and
    /// as a descriptor). The descriptor's rollback is a reflink: without
    /// reflinks in `--dir` (ext4), that row runs on a loop XFS it makes.
    #[arg(long)]
    rollback_disk_only: bool,
    /// Only measure snapshots: full, incremental, and incremental under a
    /// busy disk.
    #[arg(long)]
    snapshot_only: bool,
}

/// The `--seccomp` every spawned twig-vmm gets.
pub(crate) static VMM_SECCOMP: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// A test guest and its serial output.
struct Guest {
    vm: Vm,
    serial: Capture,
}

/// Boots the test guest; returns it and the time from `Vm::create` to its
/// first serial byte.
fn boot(shape: Shape, kernel: &Path) -> Result<(Guest, Duration), Error> {
    let serial = Capture::new();
    let start = Instant::now();
    let mut vm = Vm::create(shape, serial.writer()).context(|| "creating a VM".into())?;
    vm.boot(kernel, "console=ttyS0")
        .context(|| "booting the test guest".into())?;
    serial
        .wait_for(b"B", 0, T)
        .context(|| "waiting for the boot marker".into())?;
    let took = start.elapsed();
    testguest::wait_booted(&vm, T)?;
    Ok((Guest { vm, serial }, took))
}

/// A print command posted to the test guest.
struct Print {
    byte: u8,
    /// Serial offset its byte appears at or after.
    from: usize,
    /// Completion count that acknowledges it.
    done: u64,
}

/// Asks the guest to print `byte`.
fn post_print(vm: &mut Vm, serial: &Capture, byte: u8) -> Result<Print, Error> {
    let from = serial.bytes().len();
    let done = testguest::post(vm, Command::Print, [u64::from(byte), 0, 0])
        .context(|| "posting a print command".into())?;
    Ok(Print { byte, from, done })
}

impl Print {
    /// Waits for the byte on the serial port: the guest runs.
    fn printed(&self, serial: &Capture) -> Result<(), Error> {
        serial
            .wait_for(&[self.byte], self.from, T)
            .context(|| format!("waiting for the guest to print {:?}", self.byte as char))?;
        Ok(())
    }

    /// Waits until the guest acknowledged the command. It prints before it
    /// clears the mailbox, so a command posted between the two is lost.
    fn completed(&self, vm: &Vm) -> Result<(), Error> {
        testguest::poll(T, "the print command to complete", || {
            Ok(vm.read_u64(testguest::DONE)? >= self.done)
        })?;
        Ok(())
    }
}

/// Has the guest print `byte` and waits until it has, and acknowledged it.
fn print(vm: &mut Vm, serial: &Capture, byte: u8) -> Result<(), Error> {
    let p = post_print(vm, serial, byte)?;
    p.printed(serial)?;
    p.completed(vm)
}

/// Has the guest write `pages` scratch pages (values from `value`).
fn dirty(vm: &mut Vm, pages: u64, value: u64) -> Result<(), Error> {
    testguest::run(vm, Command::Dirty, [testguest::SCRATCH, pages, value], T)
        .context(|| format!("dirtying {pages} pages"))
}

/// Rollback after dirtying 1,000 pages and writing 4 KiB of a 64 MiB
/// read-write disk in a slot, attached by path (the snapshot's copy
/// renamed over the image) and sent as a descriptor (the copy reflinked
/// into it after a reflink backup into the store's `tmp`, as a jailed
/// VMM does; on a loop XFS made for the row when `root` lacks reflinks).
/// Reports each row's filesystem. Timed: the call (it resumes the vCPU).
fn rollback_with_disk(
    r: &mut Report,
    runs: usize,
    shape: Shape,
    kernel: &Path,
    root: &Path,
) -> Result<(), Error> {
    const N: u64 = 1000;
    for (name, sent) in [("path", false), ("fd", true)] {
        // A descriptor's rollback reflinks; without reflinks under `root`
        // this row runs on a loop XFS, dropped (unmounted) after the VM.
        let xfs = if sent && twig_store::fsops::probe_reflink(root).is_err() {
            Some(LoopXfs::new(&root.join("loop-xfs"), 1024)?)
        } else {
            None
        };
        let parent = xfs.as_ref().map_or(root, LoopXfs::mnt);
        let dir = parent.join(format!("rollback-disk-{name}"));
        let fs_type = filesystem_of(parent)?;
        let fs_used = match &xfs {
            Some(_) => format!("{fs_type} (loop, made for this row)"),
            None => fs_type,
        };
        r.value(&format!("rollback_{N}_disk_{name}_fs"), json!(fs_used));
        fs::create_dir_all(&dir).context(|| format!("creating {}", dir.display()))?;
        let store = NodeStore::open(&dir.join("store"), true)
            .context(|| format!("opening a node store in {}", dir.display()))?;
        let image = dir.join("disk.img");
        let file = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&image)
            .context(|| format!("creating {}", image.display()))?;
        std::os::unix::fs::FileExt::write_all_at(&file, &vec![0xa5u8; 64 << 20], 0)
            .context(|| format!("writing {}", image.display()))?;
        let serial = Capture::new();
        let devices = DeviceConfig {
            disk_slots: 1,
            ..Default::default()
        };
        let mut vm =
            Vm::create_with(shape, serial.writer(), &devices).context(|| "creating a VM".into())?;
        vm.boot(kernel, "console=ttyS0")
            .context(|| "booting the test guest".into())?;
        testguest::wait_booted(&vm, T)?;
        if sent {
            let f = file
                .try_clone()
                .context(|| "duplicating the image's descriptor".into())?;
            vm.attach_disk_file(0, &image, f, false)
        } else {
            vm.attach_disk(
                0,
                &twig_vmm::DiskConfig {
                    path: image.clone(),
                    read_only: false,
                },
            )
        }
        .context(|| format!("attaching {}", image.display()))?;
        vm.snapshot_into(&store, "base", Kind::Full)
            .context(|| "snapshot with a disk".into())?;
        let base = store.snapshot_dir("base");
        vm.rollback(&base)
            .context(|| "rolling back to the base snapshot".into())?;
        let mut samples = Vec::with_capacity(runs);
        for i in 0..runs {
            dirty(&mut vm, N, 7 + i as u64)?;
            // By path, the rollback renamed another file over the image.
            let live = fs::OpenOptions::new()
                .write(true)
                .open(&image)
                .context(|| format!("opening {}", image.display()))?;
            std::os::unix::fs::FileExt::write_all_at(&live, &[i as u8; 4096], 4096 * i as u64)
                .context(|| format!("writing {}", image.display()))?;
            let start = Instant::now();
            vm.rollback(&base)
                .context(|| format!("rollback with a disk ({name}), run {i}"))?;
            samples.push(start.elapsed());
        }
        r.timing(&format!("rollback_{N}_disk_{name}_ms"), &samples);
    }
    Ok(())
}

fn median(mut v: Vec<usize>) -> usize {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or(0)
}

/// Fresh, never reused snapshot directory names inside the temporary dir.
struct Dirs {
    root: PathBuf,
    next: usize,
}

impl Dirs {
    fn fresh(&mut self, tag: &str) -> PathBuf {
        self.next += 1;
        self.root.join(format!("{tag}-{}", self.next))
    }
}

pub fn run(args: &Args) -> Result<Value, Error> {
    twig_vmm::open_kvm().context(|| "this benchmark needs a usable /dev/kvm".into())?;
    if args.runs == 0 || args.clone64_runs == 0 {
        return Err("--runs and --clone64-runs must be at least 1".into());
    }
    let shape = Shape::new(args.mem_mib, 1);
    let scratch_pages = (shape.mem_size as u64).saturating_sub(testguest::SCRATCH) / PAGE;
    if scratch_pages < PAGE_COUNTS[2] {
        return Err(format!(
            "--mem-mib {} leaves {scratch_pages} scratch pages; the benchmark dirties {}",
            args.mem_mib, PAGE_COUNTS[2]
        )
        .into());
    }
    fs::create_dir_all(&args.dir).context(|| format!("creating {}", args.dir.display()))?;
    let tmp = tempfile::Builder::new()
        .prefix("twig-bench-vmm-")
        .tempdir_in(&args.dir)
        .context(|| format!("creating a temporary directory in {}", args.dir.display()))?;
    let root = std::path::absolute(tmp.path()).context(|| "resolving the temp dir".into())?;
    let kernel = testguest::write_to(&root)?;
    let fs_type = filesystem_of(&root)?;
    let store = NodeStore::open(&root.join("store"), true)
        .context(|| format!("opening a node store in {}", root.display()))?;
    let mut dirs = Dirs { root, next: 0 };
    let mut r = Report::default();
    r.value("mem_mib", json!(args.mem_mib));
    r.value("vcpus", json!(shape.vcpus));
    r.value("snapshot_fs", json!(fs_type));
    if args.rollback_disk_only {
        rollback_with_disk(&mut r, args.runs, shape, &kernel, &dirs.root)?;
        return Ok(r.into_value());
    }

    let _ = VMM_SECCOMP.set(args.vmm_seccomp.clone());
    r.value("vmm_seccomp", json!(args.vmm_seccomp));
    let bin = vmm_binary()?;
    let have_bin = bin.is_file();
    if !args.snapshot_only {
        // Boot, in-process: Vm::create to the guest's 'B'.
        let mut boots = Vec::with_capacity(args.runs);
        for i in 0..args.runs {
            let (_guest, took) = boot(shape, &kernel).context(|| format!("boot run {i}"))?;
            boots.push(took);
        }
        r.timing("boot_ms", &boots);

        // Boot, as a process: spawn `twig-vmm serve` to the guest's 'B'.
        if have_bin {
            let mut samples = Vec::with_capacity(args.runs);
            for i in 0..args.runs {
                let took = boot_process(&bin, &mut dirs, &kernel, args.mem_mib)
                    .context(|| format!("process boot run {i}"))?;
                samples.push(took);
            }
            r.timing("boot_process_ms", &samples);
        } else {
            r.value(
                "boot_process_ms",
                json!(format!("skipped: no twig-vmm binary at {}", bin.display())),
            );
        }
    }

    let (mut g, _) = boot(shape, &kernel)?;

    let mut value = 1u64;
    let base_id = snapshots::measure(&mut r, args.runs, &mut g, &store, &dirs.root, &mut value)?;
    let base = store.snapshot_dir(&base_id);
    if args.snapshot_only {
        return Ok(r.into_value());
    }

    // Rollback to the base after dirtying N pages. The first rollback moves
    // the VM's baseline from the last (deleted) incremental snapshot to the
    // base.
    g.vm.rollback(&base)
        .context(|| "rolling back to the base snapshot".into())?;
    print(&mut g.vm, &g.serial, b'r')?;
    let word = |vm: &Vm, p: u64| vm.read_u64(testguest::SCRATCH + p * PAGE);
    let base_words = (0..PAGE_COUNTS[2])
        .map(|p| word(&g.vm, p))
        .collect::<Result<Vec<u64>, _>>()?;
    let mut restored = Map::new();
    for n in PAGE_COUNTS {
        let mut samples = Vec::with_capacity(args.runs);
        let mut pages = Vec::with_capacity(args.runs);
        for i in 0..args.runs {
            value += n;
            dirty(&mut g.vm, n, value)?;
            let start = Instant::now();
            let info =
                g.vm.rollback(&base)
                    .context(|| format!("rollback of {n} pages, run {i}"))?;
            samples.push(start.elapsed());
            pages.push(info.pages_restored);
            if info.remapped || info.pages_restored < n as usize {
                return Err(format!(
                    "rollback after dirtying {n} pages: {} pages restored, remapped: {}",
                    info.pages_restored, info.remapped
                )
                .into());
            }
            for p in [0, n / 2, n - 1] {
                let (now, then) = (word(&g.vm, p)?, base_words[p as usize]);
                if now != then {
                    return Err(format!(
                        "after rollback scratch page {p} holds {now}, the snapshot {then}"
                    )
                    .into());
                }
            }
            print(&mut g.vm, &g.serial, b'r')?;
        }
        r.timing(&format!("rollback_{n}_ms"), &samples);
        restored.insert(n.to_string(), json!(median(pages)));
    }
    r.value("rollback_pages_restored_p50", Value::Object(restored));
    drop(g);
    rollback_with_disk(&mut r, args.runs, shape, &kernel, &dirs.root)?;

    restore(&mut r, args.runs, shape, &base)?;

    for (n, runs) in [(8, args.runs), (64, args.clone64_runs)] {
        let mut samples = Vec::with_capacity(runs);
        for i in 0..runs {
            samples.push(clone(&base, n).context(|| format!("{n}-way clone run {i}"))?);
        }
        r.timing(&format!("clone{n}_ms"), &samples);
    }

    if have_bin {
        process_restore_rollback(&mut r, &bin, &mut dirs, &base, args.runs)?;
    }

    if have_bin && !args.in_process {
        let (per_vm, detail) = rss_by_process(&bin, &mut dirs, &base, args.rss_vms)?;
        r.value("vmm_rss_method", json!("process"));
        r.value("vmm_rss_kib_per_vm", json!(per_vm));
        r.value("vmm_rss_detail", detail);
        r.value("max_vms_method", json!("process"));
        max_vms_processes(&mut r, &bin, &mut dirs, &base, args.max_vms_cap)?;
    } else {
        r.value("vmm_rss_method", json!("in-process (max_vms)"));
        r.value("max_vms_method", json!("in-process"));
        max_vms_in_process(&mut r, shape, &base, args.max_vms_cap)?;
    }
    Ok(r.into_value())
}

/// Restore into a pre-created VM (the pool case) and cold (with
/// `Vm::create`), to the guest printing 'R', with the phases of each.
fn restore(r: &mut Report, runs: usize, shape: Shape, base: &Path) -> Result<(), Error> {
    let mut phases: BTreeMap<&str, Vec<Duration>> = BTreeMap::new();
    let mut warm = Vec::with_capacity(runs);
    let mut cold = Vec::with_capacity(runs);
    for i in 0..2 * runs {
        let is_cold = i % 2 == 1;
        let serial = Capture::new();
        let t0 = Instant::now();
        let mut vm = Vm::create(shape, serial.writer()).context(|| "creating a VM".into())?;
        let t1 = Instant::now();
        let image = Image::open(base).context(|| format!("opening {}", base.display()))?;
        let t2 = Instant::now();
        vm.restore_image(&image)
            .context(|| format!("restore run {i}"))?;
        let t3 = Instant::now();
        let p = post_print(&mut vm, &serial, b'R')?;
        vm.resume()?;
        p.printed(&serial)?;
        let t4 = Instant::now();
        p.completed(&vm)?;
        if is_cold {
            cold.push(t4 - t0);
            phases.entry("create").or_default().push(t1 - t0);
        } else {
            warm.push(t4 - t1);
        }
        phases.entry("image_open").or_default().push(t2 - t1);
        phases.entry("restore_image").or_default().push(t3 - t2);
        phases
            .entry("post_resume_to_serial")
            .or_default()
            .push(t4 - t3);
    }
    r.timing("restore_ms", &warm);
    r.timing("restore_cold_ms", &cold);
    let mut out = Map::new();
    for (name, samples) in phases {
        let s = Summary::of(&samples);
        row(&format!("  restore phase {name}"), &s);
        out.insert(name.to_string(), json!(s));
    }
    r.insert("restore_phases_ms", Value::Object(out));
    Ok(())
}

/// One N-way clone: `Vm::clone_from` until every clone printed 'C'.
fn clone(base: &Path, n: usize) -> Result<Duration, Error> {
    let captures: Vec<Capture> = (0..n).map(|_| Capture::new()).collect();
    let start = Instant::now();
    let mut vms = Vm::clone_from(
        base,
        n,
        |i| captures[i].writer(),
        |_| DeviceConfig::default(),
    )?;
    let mut prints = Vec::with_capacity(n);
    for (vm, c) in vms.iter_mut().zip(&captures) {
        prints.push(post_print(vm, c, b'C')?);
    }
    for (c, p) in captures.iter().zip(&prints) {
        p.printed(c)?;
    }
    let took = start.elapsed();
    for (vm, p) in vms.iter().zip(&prints) {
        p.completed(vm)?;
    }
    Ok(took)
}

/// Starts twig-vmm processes (production's one VM per process), each
/// restoring `base`, until one fails or `cap` run; reports how many ran,
/// what stopped it, and memory per VM.
fn max_vms_processes(
    r: &mut Report,
    bin: &Path,
    dirs: &mut Dirs,
    base: &Path,
    cap: usize,
) -> Result<(), Error> {
    let nofile = raise_nofile()?;
    let guest_file = base.join("memory");
    let avail_before = mem_available_kib()?;
    let start = Instant::now();
    let mut vmms = Vec::new();
    let stopped = loop {
        if vmms.len() >= cap {
            break format!("the cap (--max-vms-cap {cap})");
        }
        match restored_vmm(bin, dirs, base) {
            Ok(v) => vmms.push(v),
            Err(e) => break format!("VMM {} failed: {e}", vmms.len() + 1),
        }
        if vmms.len() % 100 == 0 {
            eprintln!(
                "  {} VMMs running after {:.1} s",
                vmms.len(),
                start.elapsed().as_secs_f64()
            );
        }
    };
    let took = start.elapsed();
    // All of them still run, and what each costs.
    let (mut pss, mut private) = (0u64, 0u64);
    for (p, api) in vmms.iter_mut() {
        let stats = api.stats(T)?;
        if stats.state != RunState::Running {
            return Err(format!("twig-vmm {} is no longer running: {stats:?}", p.pid()).into());
        }
        let m = smaps(&p.pid().to_string(), &guest_file)?;
        pss += m.pss_kib;
        private += m.private_kib;
    }
    let avail_after = mem_available_kib()?;
    let n = vmms.len().max(1) as f64;
    r.value("max_vms", json!(vmms.len()));
    r.value("max_vms_stopped_by", json!(stopped));
    r.value("max_vms_nofile_limit", json!(nofile));
    r.value("max_vms_start_s", json!(took.as_secs_f64()));
    r.value("max_vms_pss_kib_per_vm", json!(pss as f64 / n));
    r.value("max_vms_private_kib_per_vm", json!(private as f64 / n));
    r.value(
        "max_vms_host_mem_kib_per_vm",
        json!((avail_before as f64 - avail_after as f64) / n),
    );
    let start = Instant::now();
    for (p, mut api) in vmms.drain(..) {
        p.shutdown(&mut api)?;
    }
    r.value("max_vms_teardown_s", json!(start.elapsed().as_secs_f64()));
    Ok(())
}

/// Restores `base` into as many VMs as run, up to `cap`, in this process;
/// reports how many ran, what stopped it, and memory per VM.
/// The `twig-vmm` binary next to this executable (see [`workspace_binary`]).
fn vmm_binary() -> Result<PathBuf, Error> {
    workspace_binary("twig-vmm")
}

/// The workspace binary `name` (package and binary of that name) next to
/// this executable. Under `cargo run` (which sets `CARGO`), it is built
/// first, with the same profile (a no-op when it is fresh), so that `cargo
/// run --release -p twig-bench -- vmm` measures the VMM of this source tree,
/// never a stale binary left next to it.
pub fn workspace_binary(name: &str) -> Result<PathBuf, Error> {
    let exe = std::env::current_exe().context(|| "finding the benchmark executable".into())?;
    let bin = exe.with_file_name(name);
    let Some(cargo) = std::env::var_os("CARGO") else {
        return Ok(bin);
    };
    let release = exe
        .parent()
        .and_then(|d| d.file_name())
        .is_some_and(|n| n == "release");
    let mut cmd = std::process::Command::new(cargo);
    cmd.args(["build", "-q", "-p", name, "--bin", name]);
    if release {
        cmd.arg("--release");
    }
    let status = cmd
        .status()
        .context(|| format!("running cargo build -p {name}"))?;
    if !status.success() {
        return Err(format!("cargo build -p {name} failed: {status}").into());
    }
    Ok(bin)
}

fn max_vms_in_process(r: &mut Report, shape: Shape, base: &Path, cap: usize) -> Result<(), Error> {
    let nofile = raise_nofile()?;
    let image = Image::open(base).context(|| format!("opening {}", base.display()))?;
    let guest_file = base.join("memory");
    let before = smaps("self", &guest_file)?;
    let avail_before = mem_available_kib()?;
    let start = Instant::now();
    let mut vms: Vec<Guest> = Vec::new();
    let stopped = loop {
        if vms.len() >= cap {
            break format!("the cap (--max-vms-cap {cap})");
        }
        match start_restored(shape, &image) {
            Ok(g) => vms.push(g),
            Err(e) => break format!("VM {} failed: {e}", vms.len() + 1),
        }
        if vms.len() % 100 == 0 {
            eprintln!(
                "  {} VMs running after {:.1} s",
                vms.len(),
                start.elapsed().as_secs_f64()
            );
        }
    };
    let took = start.elapsed();
    // All of them still run: each prints again.
    let mut prints = Vec::with_capacity(vms.len());
    for g in vms.iter_mut() {
        prints.push(post_print(&mut g.vm, &g.serial, b'Z')?);
    }
    for (g, p) in vms.iter().zip(&prints) {
        p.printed(&g.serial)?;
        p.completed(&g.vm)?;
    }
    let after = smaps("self", &guest_file)?;
    let avail_after = mem_available_kib()?;
    let n = vms.len().max(1) as f64;
    let vmm = (after.rss_kib - after.guest_rss_kib) as f64
        - (before.rss_kib - before.guest_rss_kib) as f64;
    r.value("max_vms", json!(vms.len()));
    r.value("max_vms_stopped_by", json!(stopped));
    r.value("max_vms_nofile_limit", json!(nofile));
    r.value("max_vms_start_s", json!(took.as_secs_f64()));
    r.value(
        "max_vms_guest_rss_kib_per_vm",
        json!((after.guest_rss_kib as f64 - before.guest_rss_kib as f64) / n),
    );
    r.value(
        "max_vms_host_mem_kib_per_vm",
        json!((avail_before as f64 - avail_after as f64) / n),
    );
    r.value("vmm_rss_kib_per_vm", json!(vmm / n));
    let start = Instant::now();
    drop(vms);
    r.value("max_vms_teardown_s", json!(start.elapsed().as_secs_f64()));
    Ok(())
}

/// A VM restored from `image` that has printed 'R'.
fn start_restored(shape: Shape, image: &Arc<Image>) -> Result<Guest, Error> {
    let serial = Capture::new();
    let mut vm = Vm::create(shape, serial.writer())?;
    vm.restore_image(image)?;
    let p = post_print(&mut vm, &serial, b'R')?;
    vm.resume()?;
    p.printed(&serial)?;
    p.completed(&vm)?;
    Ok(Guest { vm, serial })
}

/// Raises the soft open-file limit to the hard one; returns it.
fn raise_nofile() -> Result<u64, Error> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(format!("getrlimit(NOFILE): {}", std::io::Error::last_os_error()).into());
    }
    lim.rlim_cur = lim.rlim_max;
    // SAFETY: setrlimit reads the struct we own.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
        return Err(format!("setrlimit(NOFILE): {}", std::io::Error::last_os_error()).into());
    }
    Ok(lim.rlim_cur)
}

/// A `twig-vmm serve` child, killed and reaped if still running on drop.
pub(crate) struct VmmProcess {
    child: Child,
    sock: PathBuf,
}

impl VmmProcess {
    fn spawn(bin: &Path, sock: PathBuf, serial: &Path) -> Result<VmmProcess, Error> {
        VmmProcess::spawn_with(bin, sock, serial, &[])
    }

    pub(crate) fn spawn_with(
        bin: &Path,
        sock: PathBuf,
        serial: &Path,
        extra: &[&str],
    ) -> Result<VmmProcess, Error> {
        let child = std::process::Command::new(bin)
            .arg("serve")
            .args(extra)
            .arg("--api-sock")
            .arg(&sock)
            .arg("--serial")
            .arg(serial)
            .arg("--seccomp")
            .arg(VMM_SECCOMP.get().map_or("on", String::as_str))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .context(|| format!("starting {}", bin.display()))?;
        Ok(VmmProcess { child, sock })
    }

    /// Connects to the API socket once it is there.
    pub(crate) fn connect(&mut self) -> Result<Client, Error> {
        let deadline = Instant::now() + T;
        loop {
            match Client::connect(&self.sock, Duration::from_millis(50)) {
                Ok(api) => return Ok(api),
                Err(e) => {
                    if let Some(status) = self.child.try_wait()? {
                        return Err(
                            format!("twig-vmm exited with {status} before listening").into()
                        );
                    }
                    if Instant::now() > deadline {
                        return Err(e.into());
                    }
                }
            }
        }
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Shuts the VMM down through its API and reaps it.
    pub(crate) fn shutdown(mut self, api: &mut Client) -> Result<(), Error> {
        api.shutdown(T)?;
        let status = self
            .child
            .wait()
            .context(|| "waiting for twig-vmm".into())?;
        if !status.success() {
            return Err(format!("twig-vmm exited with {status}").into());
        }
        Ok(())
    }
}

impl Drop for VmmProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Spawns `twig-vmm serve`, boots the test guest through the API and
/// returns the time from spawn to the guest's first serial byte.
fn boot_process(
    bin: &Path,
    dirs: &mut Dirs,
    kernel: &Path,
    mem_mib: usize,
) -> Result<Duration, Error> {
    let sock = dirs.fresh("boot.sock");
    let serial = dirs.fresh("boot.serial");
    let start = Instant::now();
    let mut p = VmmProcess::spawn(bin, sock, &serial)?;
    let mut api = p.connect()?;
    api.boot(kernel, None, "console=ttyS0", mem_mib, 1, T)?;
    let deadline = Instant::now() + T;
    while fs::metadata(&serial).map(|m| m.len()).unwrap_or(0) == 0 {
        if Instant::now() > deadline {
            return Err(format!("no serial output in {} within {T:?}", serial.display()).into());
        }
        std::thread::sleep(Duration::from_micros(50));
    }
    let took = start.elapsed();
    let printed = fs::read(&serial).context(|| format!("reading {}", serial.display()))?;
    if printed.first() != Some(&b'B') {
        return Err(format!("the guest printed {printed:?}, not the boot marker").into());
    }
    p.shutdown(&mut api)?;
    fs::remove_file(&serial).context(|| format!("removing {}", serial.display()))?;
    Ok(took)
}

/// Restore and rollback as the shim sees them: API calls to a `twig-vmm
/// serve` process (with its seccomp filters unless `--vmm-seccomp off`)
/// whose VM of the right shape was prepared at start (the pool case).
fn process_restore_rollback(
    r: &mut Report,
    bin: &Path,
    dirs: &mut Dirs,
    base: &Path,
    runs: usize,
) -> Result<(), Error> {
    let meta = twig_vmm::snapshot::read_state(base)?.meta;
    let mib = (meta.mem_size >> 20).to_string();
    let (mut restores, mut rollbacks) = (Vec::with_capacity(runs), Vec::with_capacity(runs));
    for i in 0..runs {
        let sock = dirs.fresh("vmm.sock");
        let mut p = VmmProcess::spawn_with(
            bin,
            sock,
            Path::new("/dev/null"),
            &["--prepare-mem-mib", &mib],
        )?;
        let mut api = p.connect()?;
        let start = Instant::now();
        api.restore(base, T)
            .map_err(|e| format!("process restore run {i}: {e}"))?;
        restores.push(start.elapsed());
        wait_exits(&mut api)?;
        let start = Instant::now();
        api.rollback(base, T)
            .map_err(|e| format!("process rollback run {i}: {e}"))?;
        rollbacks.push(start.elapsed());
        p.shutdown(&mut api)?;
    }
    r.timing("restore_process_ms", &restores);
    r.timing("rollback_process_ms", &rollbacks);
    Ok(())
}

/// Starts a twig-vmm process and restores `base` in it through the API;
/// returns once the guest runs (has left KVM at its idle port).
fn restored_vmm(bin: &Path, dirs: &mut Dirs, base: &Path) -> Result<(VmmProcess, Client), Error> {
    let mut p = VmmProcess::spawn(bin, dirs.fresh("vmm.sock"), Path::new("/dev/null"))?;
    let mut api = p.connect()?;
    api.restore(base, T)?;
    wait_exits(&mut api)?;
    Ok((p, api))
}

/// Waits until a VMM's guest has made a VM exit: a restored VM starts with
/// none, and the test guest's first exit is its idle port, so it ran.
fn wait_exits(api: &mut Client) -> Result<(), Error> {
    let deadline = Instant::now() + T;
    loop {
        let stats = api.stats(T)?;
        if stats.exits > 0 && stats.state == RunState::Running {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("the restored guest did not run within {T:?}: {stats:?}").into());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Starts `k` twig-vmm processes, restores `base` in each through the API,
/// and returns per-process RSS beyond the guest RAM mapping.
fn rss_by_process(
    bin: &Path,
    dirs: &mut Dirs,
    base: &Path,
    k: usize,
) -> Result<(f64, Value), Error> {
    if k == 0 {
        return Err("--rss-vms must be at least 1".into());
    }
    let guest_file = base.join("memory");
    let mut vmms = (0..k)
        .map(|_| restored_vmm(bin, dirs, base))
        .collect::<Result<Vec<_>, Error>>()?;
    let mut vmm_rss = Vec::with_capacity(k);
    let mut vmm_pss = Vec::with_capacity(k);
    let mut guest = Vec::with_capacity(k);
    let mut total = Vec::with_capacity(k);
    let mut private = Vec::with_capacity(k);
    let mut breakdown = BTreeMap::new();
    for (p, _) in &vmms {
        let m = smaps(&p.pid().to_string(), &guest_file)?;
        if m.guest_size_kib == 0 {
            return Err(format!(
                "no mapping of {} in twig-vmm {}",
                guest_file.display(),
                p.pid()
            )
            .into());
        }
        total.push(m.rss_kib as f64);
        guest.push(m.guest_rss_kib as f64);
        vmm_rss.push((m.rss_kib - m.guest_rss_kib) as f64);
        vmm_pss.push(m.pss_kib as f64 - m.guest_pss_kib as f64);
        private.push(m.private_kib as f64);
        if breakdown.is_empty() {
            breakdown = m.by_name;
        }
    }
    for (p, mut api) in vmms.drain(..) {
        p.shutdown(&mut api)?;
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let max = |v: &[f64]| v.iter().copied().fold(f64::MIN, f64::max);
    eprintln!(
        "  twig-vmm processes: {k}; RSS total mean {:.0} KiB, guest mapping mean {:.0} KiB, \
         VMM beyond guest mean {:.0} KiB (max {:.0}), PSS beyond guest mean {:.0} KiB, \
         private beyond guest mean {:.0} KiB",
        mean(&total),
        mean(&guest),
        mean(&vmm_rss),
        max(&vmm_rss),
        mean(&vmm_pss),
        mean(&private)
    );
    // The first process's RSS by mapping, largest first.
    let mut top: Vec<(String, u64)> = breakdown.into_iter().filter(|(_, kib)| *kib > 0).collect();
    top.sort_by_key(|(_, kib)| std::cmp::Reverse(*kib));
    for (name, kib) in &top {
        eprintln!("    {kib:>6} KiB  {name}");
    }
    let detail = json!({
        "mean": mean(&vmm_rss),
        "max": max(&vmm_rss),
        "pss_mean": mean(&vmm_pss),
        "private_mean": mean(&private),
        "first_process_rss_by_mapping_kib": top.into_iter().map(|(n, kib)| (n, json!(kib))).collect::<Map<String, Value>>(),
        "process_rss_mean": mean(&total),
        "guest_rss_mean": mean(&guest),
        "processes": k,
    });
    Ok((mean(&vmm_rss), detail))
}

/// Memory of a process from /proc/<pid>/smaps (its totals equal
/// smaps_rollup's), with the guest RAM mapping of `guest_file` apart.
#[derive(Default)]
pub(crate) struct Mem {
    pub(crate) rss_kib: u64,
    pub(crate) pss_kib: u64,
    pub(crate) guest_size_kib: u64,
    pub(crate) guest_rss_kib: u64,
    pub(crate) guest_pss_kib: u64,
    /// Private_Clean + Private_Dirty outside the guest mapping.
    private_kib: u64,
    /// RSS outside the guest mapping by mapping name.
    by_name: BTreeMap<String, u64>,
}

pub(crate) fn smaps(pid: &str, guest_file: &Path) -> Result<Mem, Error> {
    let path = format!("/proc/{pid}/smaps");
    let text = fs::read_to_string(&path).context(|| format!("reading {path}"))?;
    let guest = guest_file.to_string_lossy();
    let deleted = format!("{guest} (deleted)");
    let mut m = Mem::default();
    let mut in_guest = false;
    let mut name = String::new();
    for line in text.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let Some(first) = fields.first() else {
            continue;
        };
        let Some(key) = first.strip_suffix(':') else {
            // A mapping's header: range perms offset dev inode [path].
            name = fields.get(5..).map(|p| p.join(" ")).unwrap_or_default();
            in_guest = name == guest || name == deleted;
            if name.is_empty() {
                name = "[anonymous]".into();
            }
            continue;
        };
        let Some(kib) = fields.get(1).and_then(|v| v.parse::<u64>().ok()) else {
            continue;
        };
        match (key, in_guest) {
            ("Size", true) => m.guest_size_kib += kib,
            ("Rss", g) => {
                m.rss_kib += kib;
                if g {
                    m.guest_rss_kib += kib;
                } else {
                    *m.by_name.entry(name.clone()).or_default() += kib;
                }
            }
            ("Private_Clean" | "Private_Dirty", false) => m.private_kib += kib,
            ("Pss", g) => {
                m.pss_kib += kib;
                if g {
                    m.guest_pss_kib += kib;
                }
            }
            _ => {}
        }
    }
    Ok(m)
}

fn mem_available_kib() -> Result<u64, Error> {
    let text = fs::read_to_string("/proc/meminfo").context(|| "reading /proc/meminfo".into())?;
    text.lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| "no MemAvailable in /proc/meminfo".into())
}

/// The type of the filesystem holding `dir` (longest mount point prefix).
fn filesystem_of(dir: &Path) -> Result<String, Error> {
    let text = fs::read_to_string("/proc/mounts").context(|| "reading /proc/mounts".into())?;
    let mut best: Option<(usize, String)> = None;
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let (Some(mnt), Some(fstype)) = (f.get(1), f.get(2)) else {
            continue;
        };
        if dir.starts_with(mnt) && best.as_ref().is_none_or(|(len, _)| mnt.len() > *len) {
            best = Some((mnt.len(), fstype.to_string()));
        }
    }
    best.map(|(_, t)| t)
        .ok_or_else(|| format!("no mount point holds {}", dir.display()).into())
}
