//! What the node's work costs it, read twice a window apart:
//!
//! - a pod's VM ([`look`], [`Cost`]): the CPU time of the `twig-vmm`
//!   process and the processes below it (a jailed VMM is a parent outside
//!   its PID namespace waiting for the VMM inside; the vCPU threads' guest
//!   time is included) and the VM exits KVM counted for their VMs
//!   (`/sys/kernel/debug/kvm/<pid>-<fd>/`, one directory per VM, each a
//!   file per counter): what an idle guest keeps doing;
//! - the whole node ([`node_look`], [`NodeCost`]): how busy its CPUs were
//!   and which programs used them, by command name, with their reaped
//!   children's time (a CNI plugin's shows under containerd): where a slow
//!   step's time went.

use std::collections::BTreeMap;
use std::fs;
use std::time::Instant;

/// KVM's per-VM debugfs directory.
const KVM_DEBUGFS: &str = "/sys/kernel/debug/kvm";

/// The exit counters worth reading (KVM's own names).
const EXITS: &[&str] = &[
    "exits",
    "halt_exits",
    "irq_exits",
    "io_exits",
    "mmio_exits",
    "irq_window_exits",
    "request_irq_exits",
    "signal_exits",
    "irq_injections",
    "insn_emulation",
];

/// One look at a VMM process.
#[derive(Debug, Clone)]
pub struct Look {
    at: Instant,
    /// utime + stime of the whole process, in clock ticks.
    ticks: u64,
    /// KVM's counters of the process's VMs, summed.
    counters: BTreeMap<&'static str, u64>,
}

/// A look at process `pid` and those below it now; `None` when it is gone.
pub fn look(pid: u32) -> Option<Look> {
    let tree = crate::process_tree(i32::try_from(pid).ok()?);
    let ticks =
        cpu_ticks(*tree.first()?)? + tree[1..].iter().filter_map(|&p| cpu_ticks(p)).sum::<u64>();
    let mut counters = BTreeMap::new();
    let prefixes: Vec<String> = tree.iter().map(|p| format!("{p}-")).collect();
    for dir in fs::read_dir(KVM_DEBUGFS).into_iter().flatten().flatten() {
        let name = dir.file_name().to_string_lossy().into_owned();
        if !prefixes.iter().any(|p| name.starts_with(p)) {
            continue;
        }
        for &name in EXITS {
            let n = fs::read_to_string(dir.path().join(name))
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok())
                .unwrap_or(0);
            *counters.entry(name).or_insert(0) += n;
        }
    }
    Some(Look {
        at: Instant::now(),
        ticks,
        counters,
    })
}

/// utime + stime of process `pid`, in clock ticks.
fn cpu_ticks(pid: i32) -> Option<u64> {
    stat_fields(pid).map(|f| f.own)
}

/// What `/proc/<pid>/stat` says of a process's CPU time.
struct StatFields {
    /// Its command name.
    comm: String,
    /// utime + stime, in clock ticks.
    own: u64,
    /// cutime + cstime: its reaped children's.
    children: u64,
}

fn stat_fields(pid: i32) -> Option<StatFields> {
    parse_stat(&fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// The fields of a `stat` file (a process's or a thread's).
fn parse_stat(stat: &str) -> Option<StatFields> {
    let (head, rest) = stat.rsplit_once(')')?;
    let comm = head.split_once('(')?.1.to_string();
    // The fields after the command's closing parenthesis start at field 3
    // (state); utime is field 14, stime 15, cutime 16, cstime 17.
    let f: Vec<u64> = rest
        .split_whitespace()
        .skip(11)
        .take(4)
        .map(|w| w.parse().unwrap_or(0))
        .collect();
    Some(StatFields {
        comm,
        own: f.first()? + f.get(1)?,
        children: f.get(2)? + f.get(3)?,
    })
}

/// One look at the whole node.
#[derive(Debug, Clone)]
pub struct NodeLook {
    at: Instant,
    /// `/proc/stat`'s first line: user, nice, system, idle, iowait, irq,
    /// softirq, steal, in clock ticks.
    cpu: Vec<u64>,
    /// Every process: its command and CPU ticks (own and reaped children's).
    processes: BTreeMap<i32, (String, u64)>,
    /// Every thread: `command/thread` and its CPU ticks.
    threads: BTreeMap<i32, (String, u64)>,
}

/// A look at the node now.
pub fn node_look() -> NodeLook {
    let cpu = fs::read_to_string("/proc/stat")
        .ok()
        .and_then(|s| {
            let line = s.lines().next()?.to_string();
            Some(
                line.split_whitespace()
                    .skip(1)
                    .take(8)
                    .map(|w| w.parse().unwrap_or(0))
                    .collect(),
            )
        })
        .unwrap_or_default();
    let (mut processes, mut threads) = (BTreeMap::new(), BTreeMap::new());
    for pid in ids("/proc") {
        let Some(f) = stat_fields(pid) else { continue };
        for tid in ids(&format!("/proc/{pid}/task")) {
            if let Some(t) = fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat"))
                .ok()
                .and_then(|s| parse_stat(&s))
            {
                threads.insert(tid, (format!("{}/{}", f.comm, t.comm), t.own));
            }
        }
        processes.insert(pid, (f.comm, f.own + f.children));
    }
    NodeLook {
        at: Instant::now(),
        cpu,
        processes,
        threads,
    }
}

/// The numeric entries of `dir` (pids in `/proc`, tids in a `task`).
fn ids(dir: &str) -> impl Iterator<Item = i32> {
    fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
}

/// What the node did between two looks.
#[derive(Debug, Clone)]
pub struct NodeCost {
    /// Seconds between the looks.
    pub secs: f64,
    /// Share of the CPUs' time that was not idle (iowait counts as idle).
    pub busy: f64,
    /// Share of the CPUs' time in user space (nice included).
    pub user: f64,
    /// Share in the kernel.
    pub system: f64,
    /// Share in interrupts and softirqs.
    pub softirq: f64,
    /// Commands by CPU seconds used, most first, with their processes now
    /// (a process's time counts from the first look, or its start; one
    /// that ended meanwhile counts in its parent's reaped children's).
    pub top: Vec<(String, f64, usize)>,
    /// Threads (`command/thread`) by CPU seconds used, most first.
    pub top_threads: Vec<(String, f64)>,
}

/// CPU seconds by name between two looks at `ids → (name, ticks)`.
fn used_by_name(
    before: &BTreeMap<i32, (String, u64)>,
    after: &BTreeMap<i32, (String, u64)>,
) -> BTreeMap<String, (f64, usize)> {
    let hz = clock_ticks_per_s();
    let mut by_name: BTreeMap<String, (f64, usize)> = BTreeMap::new();
    for (id, (name, ticks)) in after {
        let was = before
            .get(id)
            .filter(|(n, _)| n == name)
            .map_or(0, |(_, t)| *t);
        let e = by_name.entry(name.clone()).or_insert((0.0, 0));
        e.0 += ticks.saturating_sub(was) as f64 / hz;
        e.1 += 1;
    }
    by_name
}

impl NodeCost {
    /// The node's cost between `before` and `after`.
    pub fn between(before: &NodeLook, after: &NodeLook) -> NodeCost {
        let secs = after.at.duration_since(before.at).as_secs_f64().max(1e-9);
        let d: Vec<f64> = after
            .cpu
            .iter()
            .zip(before.cpu.iter().chain(std::iter::repeat(&0)))
            .map(|(a, b)| a.saturating_sub(*b) as f64)
            .collect();
        let total: f64 = d.iter().sum::<f64>().max(1.0);
        let at = |i: usize| d.get(i).copied().unwrap_or(0.0);
        let mut top: Vec<(String, f64, usize)> = used_by_name(&before.processes, &after.processes)
            .into_iter()
            .filter(|(_, (s, _))| *s > 0.0)
            .map(|(name, (s, n))| (name, s, n))
            .collect();
        top.sort_by(|a, b| b.1.total_cmp(&a.1));
        let mut top_threads: Vec<(String, f64)> = used_by_name(&before.threads, &after.threads)
            .into_iter()
            .filter(|(_, (s, _))| *s > 0.0)
            .map(|(name, (s, _))| (name, s))
            .collect();
        top_threads.sort_by(|a, b| b.1.total_cmp(&a.1));
        NodeCost {
            secs,
            busy: 1.0 - (at(3) + at(4)) / total,
            user: (at(0) + at(1)) / total,
            system: at(2) / total,
            softirq: (at(5) + at(6)) / total,
            top,
            top_threads,
        }
    }
}

impl std::fmt::Display for NodeCost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CPUs {:.0}% busy over {:.0} s (user {:.0}%, system {:.0}%, irq {:.0}%);",
            self.busy * 100.0,
            self.secs,
            self.user * 100.0,
            self.system * 100.0,
            self.softirq * 100.0
        )?;
        for (name, s, n) in self.top.iter().take(10) {
            write!(f, " {name} {s:.1} s ×{n};")?;
        }
        write!(f, " threads:")?;
        for (name, s) in self.top_threads.iter().take(8) {
            write!(f, " {name} {s:.1} s;")?;
        }
        Ok(())
    }
}

/// What a VM cost between two looks, per second.
#[derive(Debug, Clone)]
pub struct Cost {
    /// Seconds between the looks.
    pub secs: f64,
    /// CPU milliseconds the process used per second.
    pub cpu_ms_per_s: f64,
    /// Each counter's growth per second.
    pub per_s: BTreeMap<&'static str, f64>,
}

impl Cost {
    /// The cost between `before` and `after`.
    pub fn between(before: &Look, after: &Look) -> Cost {
        let secs = after.at.duration_since(before.at).as_secs_f64().max(1e-9);
        let hz = clock_ticks_per_s();
        let cpu_ms_per_s = after.ticks.saturating_sub(before.ticks) as f64 * 1000.0 / hz / secs;
        let per_s = after
            .counters
            .iter()
            .map(|(k, v)| {
                let was = before.counters.get(k).copied().unwrap_or(0);
                (*k, v.saturating_sub(was) as f64 / secs)
            })
            .collect();
        Cost {
            secs,
            cpu_ms_per_s,
            per_s,
        }
    }

    /// VM exits a second (0 when KVM's counters were not readable).
    pub fn exits_per_s(&self) -> f64 {
        self.per_s.get("exits").copied().unwrap_or(0.0)
    }
}

impl std::fmt::Display for Cost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.1} ms CPU/s over {:.1} s;",
            self.cpu_ms_per_s, self.secs
        )?;
        for (k, v) in &self.per_s {
            write!(f, " {k} {v:.1}/s")?;
        }
        Ok(())
    }
}

fn clock_ticks_per_s() -> f64 {
    // SAFETY: sysconf reads a constant of the system.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz > 0 {
        hz as f64
    } else {
        100.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_looked_at_and_costs_cpu() {
        let me = std::process::id();
        let a = look(me).expect("this process");
        // Spins until the kernel has charged it 5 ticks (however busy the
        // machine is).
        let deadline = Instant::now() + std::time::Duration::from_secs(30);
        let mut x = 0u64;
        while look(me).expect("this process").ticks < a.ticks + 5 {
            assert!(Instant::now() < deadline, "this thread never ran");
            for _ in 0..100_000 {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
            }
        }
        std::hint::black_box(x);
        let b = look(me).expect("this process");
        let c = Cost::between(&a, &b);
        assert!(c.cpu_ms_per_s > 0.0, "a busy loop used {c}");
        assert!(look(u32::MAX).is_none());
    }

    /// A shell spinning on a CPU, and its pid.
    fn spinning_shell() -> (std::process::Child, i32) {
        let child = std::process::Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .spawn()
            .expect("sh");
        let pid = i32::try_from(child.id()).expect("a pid");
        (child, pid)
    }

    /// Waits until the kernel has charged `pid` 5 ticks more than `before`
    /// (however busy the machine is); its ticks then.
    fn charged_5_ticks_more(pid: i32, before: u64) -> u64 {
        let deadline = Instant::now() + std::time::Duration::from_secs(30);
        loop {
            let t = cpu_ticks(pid).expect("the child");
            if t >= before + 5 {
                return t;
            }
            assert!(Instant::now() < deadline, "the child never ran");
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }

    #[test]
    fn the_node_look_finds_a_busy_command_at_the_top() {
        let (mut child, pid) = spinning_shell();
        let a = node_look();
        charged_5_ticks_more(pid, cpu_ticks(pid).expect("the child"));
        let b = node_look();
        let _ = child.kill();
        let _ = child.wait();
        let c = NodeCost::between(&a, &b);
        assert!(c.busy > 0.0 && c.busy <= 1.0, "{c}");
        let sh = c.top.iter().find(|(name, _, _)| name == "sh");
        assert!(
            sh.is_some_and(|(_, s, _)| *s >= 0.05),
            "the spinning shell's time is not in: {c}"
        );
        assert!(
            c.top_threads.iter().any(|(name, _)| name == "sh/sh"),
            "nor its thread's: {c}"
        );
    }

    #[test]
    fn a_child_busy_below_a_waiting_parent_is_counted() {
        let (mut child, pid) = spinning_shell();
        // This process waits; the child spins: the tree's cost holds the
        // child's, whatever else the machine runs.
        let me = std::process::id();
        let a = look(me).expect("this process");
        let child_before = cpu_ticks(pid).expect("the child");
        let child_after = charged_5_ticks_more(pid, child_before);
        let b = look(me).expect("this process");
        let _ = child.kill();
        let _ = child.wait();
        assert!(
            b.ticks - a.ticks >= child_after - child_before,
            "the tree's {} ticks miss the child's {}",
            b.ticks - a.ticks,
            child_after - child_before
        );
    }
}
