//! Benchmarks of real Linux guests with twig-agent, run inside the nested lab
//! (`tests/lab/run.sh --bench`), where /dev/kvm runs guest ring 0:
//!
//! - boot to agent ready (kernel boot, agent start, first ttrpc ping over
//!   vsock) versus template restore to agent ready (restore the template's
//!   snapshot, resume, reconnect, ping), both in a VM created ahead of time
//!   with its devices (restore is also timed including that creation): the
//!   ratio is what matters, since absolute times under TCG mean little;
//! - snapshot, incremental snapshot, rollback and 4-way clone of a guest
//!   whose container holds a 64 MiB working set in tmpfs.
//!
//! Every VM has a busybox ext4 rootfs on virtio-blk, vsock and virtio-rng.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use twig_agent::client::AgentClient;
use twig_agent::testkit;
use twig_store::NodeStore;
use twig_vmm::snapshot::Image;
use twig_vmm::{Capture, DeviceConfig, DiskConfig, Kind, Shape, Vm, VsockConfig};

use crate::stats::{row, Context, Error, Report, Summary};

const AGENT_PORT: u32 = 1024;
const READY: Duration = Duration::from_secs(180);
const CALL: Duration = Duration::from_secs(60);
const CMDLINE: &str = "console=ttyS0 reboot=k panic=-1 loglevel=4";

#[derive(clap::Args)]
pub struct Args {
    /// Timed boots (each boots the guest kernel).
    #[arg(long, default_value_t = 3)]
    boot_runs: usize,
    /// Timed runs of every other measurement.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Timed 4-way clones.
    #[arg(long, default_value_t = 5)]
    clone_runs: usize,
    /// Guest RAM, MiB.
    #[arg(long, default_value_t = 256)]
    mem_mib: usize,
    /// The container's working set, MiB, written to its tmpfs.
    #[arg(long, default_value_t = 64)]
    working_set_mib: usize,
    /// Directory under which a temporary directory is made (on a reflink
    /// filesystem, snapshots share the disk's extents).
    #[arg(long, env = "TWIG_BENCH_DIR", default_value = "/tmp")]
    dir: PathBuf,
}

fn env_path(name: &str) -> Result<PathBuf, Error> {
    std::env::var_os(name).map(PathBuf::from).ok_or_else(|| {
        format!("{name} is not set: run this inside the nested lab (tests/lab/run.sh --bench)")
            .into()
    })
}

/// One VM's host-side files.
struct Slot {
    disk: PathBuf,
    uds: PathBuf,
}

impl Slot {
    /// A VM's files; its disk starts empty (a restore fills it from the
    /// snapshot, a boot copies the rootfs image in).
    fn new(dir: &Path, name: &str) -> Result<Slot, Error> {
        let disk = dir.join(format!("{name}.ext4"));
        fs::File::create(&disk).context(|| format!("creating {}", disk.display()))?;
        Ok(Slot {
            disk,
            uds: dir.join(format!("{name}.vsock")),
        })
    }

    fn devices(&self) -> DeviceConfig {
        DeviceConfig {
            disks: vec![DiskConfig {
                path: self.disk.clone(),
                read_only: false,
            }],
            net: None,
            vsock: Some(VsockConfig {
                cid: 3,
                uds_path: self.uds.clone(),
            }),
            ..Default::default()
        }
    }

    /// Waits for the agent of `vm`; a failure says what state the VM's
    /// devices and vCPU are in.
    fn ready(&self, vm: &mut Vm) -> Result<AgentClient, Error> {
        AgentClient::wait_ready(&self.uds, AGENT_PORT, READY).map_err(|e| {
            format!(
                "agent at {}: {e}; the VM:\n{}",
                self.uds.display(),
                vm.post_mortem()
            )
            .into()
        })
    }
}

struct Guest {
    vm: Vm,
    agent: AgentClient,
}

fn sh(agent: &AgentClient, exec_id: &str, script: &str) -> Result<(), Error> {
    let (code, _, err) = agent
        .run("app", exec_id, &["sh", "-c", script], CALL)
        .context(|| format!("exec {script:?}"))?;
    if code != 0 {
        return Err(format!(
            "{script:?} exited {code}: {}",
            String::from_utf8_lossy(&err)
        )
        .into());
    }
    Ok(())
}

pub fn run(args: &Args) -> Result<Value, Error> {
    let kernel = env_path("TWIG_GUEST_KERNEL")?;
    let initrd = env_path("TWIG_AGENT_INITRD")?;
    let tmp =
        tempfile::tempdir_in(&args.dir).context(|| format!("tempdir in {}", args.dir.display()))?;
    let dir = tmp.path();
    let shape = Shape::new(args.mem_mib, 1);
    let base = dir.join("base.ext4");
    testkit::busybox_rootfs(&base, 32, &[]).context(|| "busybox rootfs".into())?;
    let mut r = Report::default();
    let mut next = 0usize;
    let mut fresh = |tag: &str| {
        next += 1;
        Slot::new(dir, &format!("{tag}{next}"))
    };

    // Boot to agent ready; the last boot becomes the template.
    let mut boots = Vec::new();
    let mut template = None;
    let mut boot_events = KvmEvents::default();
    for i in 0..args.boot_runs.max(1) {
        let slot = fresh("boot")?;
        fs::copy(&base, &slot.disk).context(|| "copying the rootfs".into())?;
        let mut vm = Vm::create_with(shape, Capture::new().writer(), &slot.devices())?;
        let before = kvm_counters();
        let t0 = Instant::now();
        vm.boot_linux(&kernel, Some(&initrd), CMDLINE)?;
        let agent = slot.ready(&mut vm).context(|| format!("boot {i}"))?;
        boots.push(t0.elapsed());
        boot_events.add(&before);
        template = Some(Guest { vm, agent });
    }
    r.timing("linux_boot_to_agent_ready_ms", &boots);
    r.value("boot_kvm_events", boot_events.per_phase());
    let mut g = template.ok_or("no boot")?;
    g.vm.pause()?;
    let store = NodeStore::open(&dir.join("store"), true)?;
    let info = g.vm.snapshot_into(&store, "template", Kind::Full)?;
    let tpl = store.snapshot_dir("template");
    r.value("template_snapshot_ms", json!(info.duration_ms));
    drop(g);

    // Template restore to agent ready: into a VM created for it (with its
    // devices) ahead of time, as a pool does, and including that creation.
    let mut restores = Vec::new();
    let mut cold = Vec::new();
    let mut phases: [Vec<Duration>; 4] = Default::default();
    let mut resume_events = KvmEvents::default();
    for _ in 0..args.runs {
        let slot = fresh("restore")?;
        let t0 = Instant::now();
        let mut vm = Vm::create_with(shape, Capture::new().writer(), &slot.devices())?;
        let t1 = Instant::now();
        let image = Image::open(&tpl)?;
        let t2 = Instant::now();
        vm.restore_image(&image)?;
        let before = kvm_counters();
        let t3 = Instant::now();
        vm.resume()?;
        slot.ready(&mut vm)?;
        let t4 = Instant::now();
        resume_events.add(&before);
        restores.push(t4 - t1);
        cold.push(t4 - t0);
        for (p, d) in phases.iter_mut().zip([t1 - t0, t2 - t1, t3 - t2, t4 - t3]) {
            p.push(d);
        }
        drop(vm);
        fs::remove_file(&slot.disk).context(|| format!("removing {}", slot.disk.display()))?;
    }
    r.timing("linux_restore_to_agent_ready_ms", &restores);
    r.timing("linux_restore_cold_to_agent_ready_ms", &cold);
    let mut split = serde_json::Map::new();
    for (name, p) in ["create", "image_open", "restore_image", "resume_to_ping"]
        .iter()
        .zip(&phases)
    {
        let s = Summary::of(p);
        row(&format!("  restore phase {name}"), &s);
        split.insert(name.to_string(), json!(s));
    }
    r.insert("restore_phases_ms", Value::Object(split));
    r.value("resume_to_ping_kvm_events", resume_events.per_phase());
    let ratio = median_ms(&boots) / median_ms(&restores);
    r.value("boot_over_restore_ratio", json!(ratio));

    // A container with a working set.
    let slot = fresh("ws")?;
    let mut vm = Vm::create_with(shape, Capture::new().writer(), &slot.devices())?;
    vm.restore(&tpl)?;
    vm.resume()?;
    let agent = slot.ready(&mut vm)?;
    let spec_json = testkit::spec(&["sleep", "1000000"], json!({}));
    agent.create_container("app", "/dev/vda", false, &spec_json, CALL)?;
    agent.start_container("app", CALL)?;
    let ws = args.working_set_mib;
    let write_ws = |agent: &AgentClient, id: &str| {
        sh(
            agent,
            id,
            &format!("dd if=/dev/zero of=/tmp/ws bs=1M count={ws} conv=notrunc 2>/dev/null"),
        )
    };
    write_ws(&agent, "ws0")?;
    let mut g = Guest { vm, agent };

    let mut full = Vec::new();
    let mut incr = Vec::new();
    let mut incr_pages = Vec::new();
    let mut rollbacks = Vec::new();
    let mut rollback_ready = Vec::new();
    let mut clones = Vec::new();
    let mut parent: Option<(String, String)> = None;
    for i in 0..args.runs {
        g.vm.pause()?;
        let s = format!("full{i}");
        full.push(ms(g.vm.snapshot_into(&store, &s, Kind::Full)?.duration_ms));
        // The lab's /tmp is RAM: keep only the snapshots still needed.
        if let Some((old_full, old_incr)) = parent.take() {
            for id in [old_incr, old_full] {
                store.delete(&id).context(|| format!("deleting {id}"))?;
            }
        }
        g.vm.resume()?;
        write_ws(&g.agent, &format!("w{i}"))?;
        g.vm.pause()?;
        let inc = format!("incr{i}");
        let info = g.vm.snapshot_into(&store, &inc, Kind::Incremental)?;
        incr.push(ms(info.duration_ms));
        incr_pages.push(info.pages_written);
        g.vm.resume()?;
        write_ws(&g.agent, &format!("x{i}"))?;
        let t0 = Instant::now();
        let rb = g.vm.rollback(&store.snapshot_dir(&inc))?;
        rollbacks.push(ms(rb.duration_ms));
        g.agent = slot.ready(&mut g.vm)?;
        rollback_ready.push(t0.elapsed());
        parent = Some((s, inc));
    }
    r.timing("ws_snapshot_full_ms", &full);
    r.timing("ws_snapshot_incr_ms", &incr);
    r.value("ws_snapshot_incr_pages", json!(incr_pages));
    r.timing("ws_rollback_ms", &rollbacks);
    r.timing("ws_rollback_to_agent_ready_ms", &rollback_ready);

    let (_, snap) = parent.ok_or("no snapshot")?;
    let snap = store.snapshot_dir(&snap);
    for i in 0..args.clone_runs {
        let slots = (0..4)
            .map(|k| Slot::new(dir, &format!("clone{i}-{k}")))
            .collect::<Result<Vec<Slot>, Error>>()?;
        let t0 = Instant::now();
        let mut vms = Vm::clone_from(
            &snap,
            4,
            |_| Capture::new().writer(),
            |k| slots[k].devices(),
        )?;
        for (s, vm) in slots.iter().zip(vms.iter_mut()) {
            s.ready(vm)?;
        }
        clones.push(t0.elapsed());
        drop(vms);
        for s in &slots {
            fs::remove_file(&s.disk).context(|| format!("removing {}", s.disk.display()))?;
        }
    }
    r.timing("ws_clone4_to_agents_ready_ms", &clones);
    r.value("mem_mib", json!(args.mem_mib));
    r.value("working_set_mib", json!(ws));
    Ok(r.into_value())
}

/// KVM's VM-wide event counters (exits, page faults fixed, halts, ...),
/// summed over every VM, from debugfs; empty where it is not mounted.
fn kvm_counters() -> BTreeMap<String, u64> {
    let Ok(dir) = fs::read_dir("/sys/kernel/debug/kvm") else {
        return BTreeMap::new();
    };
    dir.flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .filter_map(|e| {
            let v = fs::read_to_string(e.path()).ok()?.trim().parse().ok()?;
            Some((e.file_name().to_string_lossy().into_owned(), v))
        })
        .collect()
}

/// Counts KVM events over phases, to say where a phase's time goes.
#[derive(Default)]
struct KvmEvents {
    total: BTreeMap<String, u64>,
    phases: u64,
}

impl KvmEvents {
    fn add(&mut self, before: &BTreeMap<String, u64>) {
        for (k, v) in kvm_counters() {
            let d = v.saturating_sub(before.get(&k).copied().unwrap_or(0));
            *self.total.entry(k).or_default() += d;
        }
        self.phases += 1;
    }

    /// The non-zero counters, averaged per phase.
    fn per_phase(&self) -> Value {
        let n = self.phases.max(1);
        Value::Object(
            self.total
                .iter()
                .filter(|(_, v)| **v > 0)
                .map(|(k, v)| (k.clone(), json!(v / n)))
                .collect(),
        )
    }
}

fn ms(v: f64) -> Duration {
    Duration::from_secs_f64(v / 1e3)
}

fn median_ms(v: &[Duration]) -> f64 {
    Summary::of(v).p50
}
