//! `twig-bench fc`: twig-vmm and Firecracker side by side on the same guest,
//! runs alternating, each VMM a process driven through its own API.
//!
//! The guest is the counter guest (`bench/guests/counter.S`, an ELF loaded
//! at 1 MiB, no disk: it needs no rootfs), 128 MiB and 1 vCPU: it prints
//! "0\n1\n2\n..." on COM1, waiting 300,000 turns of a register loop
//! (about 0.1 ms here; not the TSC, which VMMs restore differently) after
//! each line, checking and rewriting one of 1,000 scratch pages per line. Firecracker's serial
//! console goes to a file (`PUT /serial`), twig-vmm's to `--serial`.
//!
//! One run of one VMM: boot (spawn → first line), pause and resume calls,
//! a full snapshot of the running guest, 1,000 more lines (every scratch
//! page rewritten), a diff snapshot, the source stopped; then the full
//! snapshot restored into a new process (spawn → running, then → first
//! line; twig-vmm told the shape on its command line, and also without it)
//! and into a pre-started one (the call, then → first line), each
//! restored guest's output checked to continue the source's exactly, and
//! the restored VMM's memory beyond the guest's read from smaps.

mod http;
mod vmms;

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};
use twig_store::NodeStore;

use crate::stats::{Context, Error, Summary};
use vmms::{len, Env, Instance, Snap, Which};

/// Deadline of every wait on a guest or a VMM.
const T: Duration = Duration::from_secs(20);
/// Lines the guest prints between the full and the diff snapshot (it
/// rewrites one of its 1,000 scratch pages per line).
const DIFF_LINES: u64 = 1000;
/// The guest image.
const GUEST: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/counter.elf"));

#[derive(clap::Args)]
pub struct Args {
    /// The Firecracker binary (build it with scripts/build-firecracker.sh).
    #[arg(long, env = "TWIG_FIRECRACKER")]
    firecracker: Option<PathBuf>,
    /// Runs of each VMM (alternating), after one untimed warm-up run each.
    #[arg(short = 'n', long, default_value_t = 20)]
    runs: usize,
    /// Directory under which a temporary directory is made (snapshots,
    /// sockets, serial files).
    #[arg(long, default_value = "/tmp")]
    dir: PathBuf,
    /// `--seccomp` of the twig-vmm processes (Firecracker built for the gnu
    /// target has an empty default filter).
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    vmm_seccomp: String,
}

/// The binary `--firecracker` names, checked before anything else runs.
fn firecracker_binary(arg: Option<&Path>) -> Result<PathBuf, Error> {
    let Some(path) = arg else {
        return Err(
            "no Firecracker binary: pass --firecracker PATH or set TWIG_FIRECRACKER \
                    (build one with scripts/build-firecracker.sh)"
                .into(),
        );
    };
    let meta = fs::metadata(path).map_err(|e| {
        format!(
            "Firecracker binary {}: {e} (build one with scripts/build-firecracker.sh)",
            path.display()
        )
    })?;
    if !meta.is_file() || meta.permissions().mode() & 0o111 == 0 {
        return Err(format!(
            "Firecracker binary {} is not an executable file",
            path.display()
        )
        .into());
    }
    Ok(path.to_path_buf())
}

/// Samples of one VMM.
#[derive(Default)]
struct Samples {
    times: BTreeMap<&'static str, Vec<Duration>>,
    kib: BTreeMap<&'static str, Vec<f64>>,
    checked: usize,
}

impl Samples {
    fn time(&mut self, key: &'static str, d: Duration) {
        self.times.entry(key).or_default().push(d);
    }
}

pub fn run(args: &Args) -> Result<Value, Error> {
    let firecracker = firecracker_binary(args.firecracker.as_deref())?;
    twig_vmm::open_kvm().context(|| "this benchmark needs a usable /dev/kvm".into())?;
    if args.runs == 0 {
        return Err("-n must be at least 1".into());
    }
    let _ = crate::vmm::VMM_SECCOMP.set(args.vmm_seccomp.clone());
    let twig = crate::vmm::workspace_binary("twig-vmm")?;
    if !twig.is_file() {
        return Err(format!("no twig-vmm binary at {}", twig.display()).into());
    }
    let version = std::process::Command::new(&firecracker)
        .arg("--version")
        .output()
        .context(|| format!("running {} --version", firecracker.display()))?;
    let fc_version = String::from_utf8_lossy(&version.stdout)
        .lines()
        .next()
        .unwrap_or_default()
        .to_string();

    fs::create_dir_all(&args.dir).context(|| format!("creating {}", args.dir.display()))?;
    let tmp = tempfile::Builder::new()
        .prefix("twig-bench-fc-")
        .tempdir_in(&args.dir)
        .context(|| format!("creating a temporary directory in {}", args.dir.display()))?;
    let root = std::path::absolute(tmp.path()).context(|| "resolving the temp dir".into())?;
    let kernel = root.join("counter.elf");
    fs::write(&kernel, GUEST).context(|| format!("writing {}", kernel.display()))?;
    let store = NodeStore::open(&root.join("store"), true)
        .context(|| format!("opening a node store in {}", root.display()))?;
    let mut env = Env::new(twig, firecracker.clone(), store, root.clone());

    eprintln!(
        "twig-bench fc: {} and {fc_version}, {} runs each, alternating",
        env.twig.display(),
        args.runs
    );
    let mut samples = [Samples::default(), Samples::default()];
    let order = [Which::Twig, Which::Firecracker];
    for i in 0..=args.runs {
        // Run 0 is a warm-up of each (page cache, first mappings): not kept.
        let pair = if i % 2 == 0 {
            [order[0], order[1]]
        } else {
            [order[1], order[0]]
        };
        for which in pair {
            let mut s = Samples::default();
            one_run(&mut env, which, &kernel, &mut s)
                .map_err(|e| format!("{} run {i}: {e}", which.name()))?;
            if i > 0 {
                let into = &mut samples[which as usize];
                for (k, v) in s.times {
                    into.times.entry(k).or_default().extend(v);
                }
                for (k, v) in s.kib {
                    into.kib.entry(k).or_default().extend(v);
                }
                into.checked += s.checked;
            }
        }
    }
    Ok(report(&samples, args, &fc_version, &firecracker))
}

/// One run of one VMM (see the module doc).
fn one_run(env: &mut Env, which: Which, kernel: &Path, s: &mut Samples) -> Result<(), Error> {
    // Boot: spawn → first line.
    let start = Instant::now();
    let mut src = vmms::start(env, which, false)?;
    src.boot(kernel)?;
    wait_lines(&src, 0, 1)?;
    s.time("boot_first_line", start.elapsed());
    s.time("boot_spawn_to_api", src.spawn_to_api);
    wait_lines(&src, 0, 20)?;

    // Pause and resume calls.
    let t = Instant::now();
    src.pause()?;
    s.time("pause_call", t.elapsed());
    let t = Instant::now();
    src.resume()?;
    s.time("resume_call", t.elapsed());
    let before = lines(&src.serial)?;
    wait_lines(&src, 0, before + 5)?;

    // Full snapshot of the running guest, then 1,000 lines, then a diff.
    let full = src.snapshot(env, true)?;
    s.time("snapshot_full_call", full.call);
    s.time("snapshot_full_stopped", full.stopped);
    if let Some(p) = full.publish {
        s.time("snapshot_full_publish", p);
    }
    let at = lines(&src.serial)?;
    wait_lines(&src, 0, at + DIFF_LINES + 1)?;
    let diff = src.snapshot(env, false)?;
    s.time("snapshot_diff_call", diff.call);
    s.time("snapshot_diff_stopped", diff.stopped);
    if let Some(p) = diff.publish {
        s.time("snapshot_diff_publish", p);
    }
    wait_lines(&src, 0, lines(&src.serial)? + 5)?;
    check_prefix(&fs::read(&src.serial)?).map_err(|e| format!("the source guest: {e}"))?;
    src.stop()?;

    // Restore into a new process: spawn → running, then → first line.
    // twig-vmm is told the VM's shape on its command line, as twig-node
    // starts a VMM for a request: it creates the VM while its API starts.
    let start = Instant::now();
    let mut cold = vmms::start(env, which, true)?;
    cold.restore(&full.snap)?;
    let running = Instant::now();
    s.time("restore_spawn_to_running", running - start);
    s.time("restore_spawn_to_api", cold.spawn_to_api);
    s.time("restore_cold_call", running - start - cold.spawn_to_api);
    wait_new_line(&cold)?;
    s.time("restore_cold_first_line", running.elapsed());
    s.time("restore_spawn_to_first_line", start.elapsed());
    check_restored(&cold, full.printed, "cold restore")?;
    s.checked += 1;
    memory(&cold, &full.snap, "cold", s)?;
    cold.stop()?;
    if which == Which::Twig {
        // The same without the shape: the VM is created inside the call.
        let start = Instant::now();
        let mut bare = vmms::start(env, which, false)?;
        bare.restore(&full.snap)?;
        s.time("restore_spawn_to_running_no_shape", start.elapsed());
        check_restored(&bare, full.printed, "cold restore without the shape")?;
        bare.stop()?;
    }

    // Restore into a pre-started VMM: the call, then → first line.
    let mut warm = vmms::start(env, which, true)?;
    let t = Instant::now();
    warm.restore(&full.snap)?;
    let running = Instant::now();
    s.time("restore_warm_call", running - t);
    wait_new_line(&warm)?;
    s.time("restore_warm_first_line", running.elapsed());
    check_restored(&warm, full.printed, "restore into a pre-started VMM")?;
    s.checked += 1;
    memory(&warm, &full.snap, "warm", s)?;
    warm.stop()?;

    remove(&full.snap);
    remove(&diff.snap);
    Ok(())
}

fn remove(snap: &Snap) {
    if snap.state.is_dir() {
        let _ = fs::remove_dir_all(&snap.state);
    } else {
        let _ = fs::remove_file(&snap.state);
        let _ = fs::remove_file(&snap.memory);
    }
}

/// The restored VMM's RSS and PSS beyond the guest memory mapping (the
/// snapshot's memory file), KiB.
fn memory(vm: &Instance, snap: &Snap, tag: &str, s: &mut Samples) -> Result<(), Error> {
    let m = crate::vmm::smaps(&vm.pid().to_string(), &snap.memory)?;
    if m.guest_size_kib == 0 {
        return Err(format!(
            "{} {} does not map {}",
            vm.which.name(),
            vm.pid(),
            snap.memory.display()
        )
        .into());
    }
    let (rss, pss) = (
        (m.rss_kib - m.guest_rss_kib) as f64,
        m.pss_kib as f64 - m.guest_pss_kib as f64,
    );
    let (rk, pk) = match tag {
        "cold" => ("vmm_rss_kib", "vmm_pss_kib"),
        _ => ("vmm_rss_warm_kib", "vmm_pss_warm_kib"),
    };
    s.kib.entry(rk).or_default().push(rss);
    s.kib.entry(pk).or_default().push(pss);
    Ok(())
}

/// Newlines in a serial file.
fn lines(path: &Path) -> Result<u64, Error> {
    match fs::read(path) {
        Ok(b) => Ok(b.iter().filter(|c| **c == b'\n').count() as u64),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(0),
        Err(e) => Err(format!("reading {}: {e}", path.display()).into()),
    }
}

/// Waits until the guest has printed `n` lines in its serial file (which
/// had `from` bytes when the wait's count started: lines are counted in
/// all of it).
fn wait_lines(vm: &Instance, from: u64, n: u64) -> Result<(), Error> {
    let deadline = Instant::now() + T;
    loop {
        if len(&vm.serial) > from && lines(&vm.serial)? >= n {
            return Ok(());
        }
        if Instant::now() > deadline {
            let text = fs::read(&vm.serial).unwrap_or_default();
            let tail = String::from_utf8_lossy(&text[text.len().saturating_sub(64)..]).into_owned();
            return Err(format!(
                "{}: fewer than {n} lines in {} within {T:?} (ends {tail:?})",
                vm.which.name(),
                vm.serial.display()
            )
            .into());
        }
        std::thread::sleep(Duration::from_micros(50));
    }
}

/// Waits for the first newline a restored guest prints.
fn wait_new_line(vm: &Instance) -> Result<(), Error> {
    wait_lines(vm, 0, 1)
}

/// The guest's whole output: "0\n1\n2\n..." up to at least `n` bytes.
fn canonical(n: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(n + 24);
    let mut c = 0u64;
    while out.len() < n {
        out.extend_from_slice(format!("{c}\n").as_bytes());
        c += 1;
    }
    out
}

/// A guest's output from boot must be the canonical stream's start.
fn check_prefix(out: &[u8]) -> Result<(), String> {
    let want = canonical(out.len());
    if out != &want[..out.len()] {
        let at = out.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0);
        let show = |b: &[u8]| {
            String::from_utf8_lossy(&b[at.saturating_sub(16)..(at + 16).min(b.len())]).into_owned()
        };
        return Err(format!(
            "its output departs from 0,1,2,... at byte {at}: {:?}, expected {:?}",
            show(out),
            show(&want)
        ));
    }
    Ok(())
}

/// The restored guest must go on exactly from where the source stopped:
/// its output, once it printed a few lines, is the canonical stream from
/// an offset the source's serial file had reached when it was stopped
/// (`printed`, a range for twig-vmm, which pauses inside its call).
fn check_restored(vm: &Instance, printed: (u64, u64), what: &str) -> Result<(), Error> {
    wait_lines(vm, 0, 3)?;
    let out = fs::read(&vm.serial).context(|| format!("reading {}", vm.serial.display()))?;
    let (lo, hi) = (printed.0 as usize, printed.1 as usize);
    let want = canonical(hi + out.len());
    if (lo..=hi).any(|o| want[o..].starts_with(&out)) {
        return Ok(());
    }
    Err(format!(
        "{what}: the restored guest printed {:?}, which does not continue the source's \
         output at any byte from {lo} to {hi} (there: {:?})",
        String::from_utf8_lossy(&out[..out.len().min(40)]),
        String::from_utf8_lossy(&want[lo..(hi + 24).min(want.len())]),
    )
    .into())
}

/// p50/p90 of plain values.
fn pct(v: &[f64]) -> (f64, f64) {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let pick = |q: f64| {
        if s.is_empty() {
            f64::NAN
        } else {
            s[((s.len() as f64 - 1.0) * q).round() as usize]
        }
    };
    (pick(0.5), pick(0.9))
}

/// The table (stderr) and the JSON.
fn report(samples: &[Samples; 2], args: &Args, fc_version: &str, fc: &Path) -> Value {
    let [tw, fcs] = samples;
    let mut keys: Vec<&str> = tw.times.keys().chain(fcs.times.keys()).copied().collect();
    keys.sort_unstable();
    keys.dedup();
    eprintln!(
        "{:<30} {:>19} {:>19} {:>15}",
        "(ms; n per VMM)", "twig p50 / p90", "firecracker p50/p90", "twig/fc p50 p90"
    );
    let mut out = Map::new();
    let mut ratios = Map::new();
    let fmt = |s: Option<&Summary>| match s {
        Some(s) => format!("{:>9.3} {:>9.3}", s.p50, s.p90),
        None => format!("{:>9} {:>9}", "-", "-"),
    };
    let (mut tj, mut fj) = (Map::new(), Map::new());
    for k in keys {
        let t = tw.times.get(k).map(|v| Summary::of(v));
        let f = fcs.times.get(k).map(|v| Summary::of(v));
        let ratio = match (&t, &f) {
            (Some(t), Some(f)) => {
                let r = (t.p50 / f.p50, t.p90 / f.p90);
                ratios.insert(format!("{k}_ms"), json!({"p50": r.0, "p90": r.1}));
                format!("{:>7.2} {:>7.2}", r.0, r.1)
            }
            _ => String::new(),
        };
        eprintln!("{k:<30} {} {} {ratio}", fmt(t.as_ref()), fmt(f.as_ref()));
        if let Some(t) = t {
            tj.insert(format!("{k}_ms"), json!(t));
        }
        if let Some(f) = f {
            fj.insert(format!("{k}_ms"), json!(f));
        }
    }
    for k in [
        "vmm_rss_kib",
        "vmm_pss_kib",
        "vmm_rss_warm_kib",
        "vmm_pss_warm_kib",
    ] {
        let (t, f) = (
            pct(tw.kib.get(k).map_or(&[][..], Vec::as_slice)),
            pct(fcs.kib.get(k).map_or(&[][..], Vec::as_slice)),
        );
        let r = (t.0 / f.0, t.1 / f.1);
        eprintln!(
            "{k:<30} {:>9.0} {:>9.0} {:>9.0} {:>9.0} {:>7.2} {:>7.2}",
            t.0, t.1, f.0, f.1, r.0, r.1
        );
        tj.insert(k.into(), json!({"p50": t.0, "p90": t.1}));
        fj.insert(k.into(), json!({"p50": f.0, "p90": f.1}));
        ratios.insert(k.into(), json!({"p50": r.0, "p90": r.1}));
    }
    eprintln!(
        "restored guests checked to continue exactly: twig {}, firecracker {}",
        tw.checked, fcs.checked
    );
    out.insert("runs".into(), json!(args.runs));
    out.insert("mem_mib".into(), json!(vmms::MEM_MIB));
    out.insert("vmm_seccomp".into(), json!(args.vmm_seccomp));
    out.insert("firecracker_version".into(), json!(fc_version));
    out.insert("firecracker_binary".into(), json!(fc.display().to_string()));
    out.insert(
        "restores_checked".into(),
        json!({"twig": tw.checked, "firecracker": fcs.checked}),
    );
    out.insert("twig".into(), Value::Object(tj));
    out.insert("firecracker".into(), Value::Object(fj));
    out.insert("ratio_twig_over_fc".into(), Value::Object(ratios));
    Value::Object(out)
}
