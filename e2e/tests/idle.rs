//! An idle pod's VM stays idle: a pod restored from the node's template,
//! whose only process sleeps, takes (almost) no timer interrupts. Every
//! timer interrupt of a guest is a VM exit and a wake-up of a host CPU, and
//! a node holds many idle pods (agents waiting for their next request).
//!
//! The guest kernel is tickless (`NO_HZ_IDLE`, guest/kernel.config): with
//! nothing to run it programs no tick. The test reads the guest's
//! `/proc/interrupts` twice, [`WINDOW`] apart, and checks the timer lines
//! (`0:`, the i8254 PIT; `LOC`, the local APIC timer) grew by less than
//! [`MAX_PER_S`] a second.
//! Built with `--features lab`, run in the nested lab
//! (`tests/lab/run.sh -p twig-e2e --features twig-e2e/lab --test idle`).

use std::time::{Duration, Instant};

use twig_cri::container_config;
use twig_e2e::crilab::{runtime, CriLab};
use twig_e2e::{cost, IMAGE_REF};

/// How long the pod is watched.
const WINDOW: Duration = Duration::from_secs(10);
/// Timer interrupts a second an idle guest may take (the lab's agent and
/// the exec that reads the counts wake it now and then).
const MAX_PER_S: f64 = 20.0;

/// The count of the `/proc/interrupts` line named `irq` (`0`, `LOC`),
/// summed over CPUs.
fn count(interrupts: &str, irq: &str) -> u64 {
    interrupts
        .lines()
        .find(|l| l.trim_start().starts_with(&format!("{irq}:")))
        .map(|l| {
            l.split_whitespace()
                .skip(1)
                .map_while(|w| w.parse::<u64>().ok())
                .sum()
        })
        .unwrap_or(0)
}

#[test]
fn an_idle_pods_vm_takes_no_periodic_timer_interrupts() {
    runtime().block_on(async {
        let lab = CriLab::start().await;
        let pod = lab
            .node
            .pod_config("idle")
            .unwrap_or_else(|e| panic!("{e}"));
        let container = container_config("idle", IMAGE_REF, &["sleep", "100000"], "idle.log");
        let (pod_id, id) = lab.run_pod(&pod, "twig", &container).await;

        let (_, timers) = lab
            .exec(
                &id,
                &[
                    "sh",
                    "-c",
                    "grep -E 'Clock Event Device|mode:|event_handler' /proc/timer_list; \
                     dmesg | grep -iE 'clocksource|clockevent|apic|tsc|pit|hpet|nohz|tick' | tail -20",
                ],
            )
            .await;
        eprintln!("idle: the guest's timers:\n{timers}");
        let vmm = match lab.node.pod_vmms()[..] {
            [pid] => pid,
            ref other => panic!("the pod's VMM: found {other:?}"),
        };
        let (code, before) = lab
            .exec(&id, &["cat", "/proc/interrupts", "/proc/softirqs"])
            .await;
        assert_eq!(code, 0, "reading /proc/interrupts: {before}");
        let cost_before = cost::look(vmm).expect("the pod's VMM runs");
        let t = Instant::now();
        // A measurement window, not a synchronisation: the guest is left
        // alone for it.
        tokio::time::sleep(WINDOW).await;
        let cost = cost::Cost::between(
            &cost_before,
            &cost::look(vmm).expect("the pod's VMM runs"),
        );
        eprintln!("idle: the VMM while the guest idled: {cost}");
        let (_, after) = lab
            .exec(&id, &["cat", "/proc/interrupts", "/proc/softirqs"])
            .await;
        let secs = t.elapsed().as_secs_f64();
        eprintln!(
            "idle: /proc/interrupts and /proc/softirqs before:\n{before}\nafter {secs:.1} s:\n{after}"
        );
        for irq in ["0", "LOC"] {
            let rate = count(&after, irq).saturating_sub(count(&before, irq)) as f64 / secs;
            assert!(
                rate < MAX_PER_S,
                "the idle guest took {rate:.0} interrupts a second on `{irq}:` \
                 (at most {MAX_PER_S}):\n{before}\n---\n{after}\n{timers}"
            );
        }
        lab.remove_pod(&pod_id).await;
    });
}
