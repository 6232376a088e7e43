//! VM shapes: a node offering two base template shapes (the default one
//! kept warm, the larger one not) answers `AcquireVm` per shape — the
//! default for a pod without limits, the smallest that fits the pod's
//! limits plus the guest reserve, an exact shape if offered — refuses a pod
//! that fits none and an unknown exact shape before any VMM is taken, and
//! gives a restore-from pod its snapshot's shape if the pod fits it. The
//! base templates stand in for the build: the ring-3 test guest
//! snapshotted under the ids twig-node derives from its configuration.

mod common;

use std::path::Path;

use common::*;
use twig_node::template::{Shape as NodeShape, Templates};
use twig_proto::node::{AcquireVmRequest, AcquireVmResponse};
use twig_vmm::api::Client;
use twig_vmm::RunState;

const MIB_BYTES: u64 = 1 << 20;
/// The larger shape the test node offers (not kept warm).
const BIG: u32 = 128;
/// The test node's guest reserve.
const RESERVE: u32 = 16;

/// A node offering `MIB` × 1 (default, one warm VMM) and `BIG` × 1, with
/// its base templates of both shapes in the store. Their ids by shape.
fn shaped_node(dir: &Path) -> (Node, String, String) {
    for f in ["kernel", "initrd"] {
        std::fs::write(dir.join(f), f).unwrap();
    }
    let mut c = config(dir, 1);
    c["base"]["kernel"] = serde_json::json!(dir.join("kernel"));
    c["base"]["initrd"] = serde_json::json!(dir.join("initrd"));
    c["base"]["shapes"] = serde_json::json!([{"mem_mib": BIG}]);
    c["base"]["guest_reserve_mib"] = serde_json::json!(RESERVE);
    let parsed: twig_node::Config = serde_json::from_value(c.clone()).unwrap();
    let templates = Templates::open(&parsed).unwrap();
    let id = |mem_mib| {
        templates
            .base_id(NodeShape {
                mem_mib,
                vcpus: 1,
                disk_slots: SLOTS,
            })
            .unwrap()
    };
    let (small, big) = (id(MIB), id(BIG));
    make_template_of(dir, &small, MIB);
    make_template_of(dir, &big, BIG);
    let node = Node::start(dir, &c);
    wait_until("the pool holds 1 VMM", T, || node.pooled().len() == 1);
    (node, small, big)
}

fn limits(memory_limit_mib: u64, cpu_limit_millis: u32) -> AcquireVmRequest {
    AcquireVmRequest {
        sandbox_id: "shaped".into(),
        memory_limit_bytes: memory_limit_mib * MIB_BYTES,
        cpu_limit_millis,
        ..Default::default()
    }
}

/// Restores the handed-over VM's template as the shim does, checks the
/// guest runs with `mib` MiB, and stops it.
fn restore_and_stop(vm: &AcquireVmResponse, mib: u32) {
    assert_eq!((vm.memory_mib, vm.vcpus, vm.disk_slots), (mib, 1, SLOTS));
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", vm.pid)).unwrap();
    let args: Vec<String> = cmdline
        .split(|b| *b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let at = args
        .iter()
        .position(|a| a == "--prepare-mem-mib")
        .unwrap_or_else(|| panic!("no --prepare-mem-mib in {args:?}"));
    assert_eq!(args[at + 1], mib.to_string(), "{args:?}");
    let mut api = Client::connect(Path::new(&vm.api_socket), T).expect("connect");
    api.restore(Path::new(&vm.template_dir), T)
        .expect("restore the template into the VM of its shape");
    wait_until("the restored guest runs", T, || {
        let s = api.stats(T).expect("stats");
        s.exits > 0 && s.state == RunState::Running
    });
    api.shutdown(T).expect("shutdown");
    wait_until("the stopped VMM is reaped", T, || gone(vm.pid));
}

#[test]
fn the_pods_limits_choose_the_smallest_base_shape_that_fits() {
    let dir = tempfile::tempdir().unwrap();
    let (node, small, big) = shaped_node(dir.path());

    // Status lists the offered shapes, the default first, and the reserve;
    // only the default shape is kept warm.
    let status = node.status();
    let shapes: Vec<(u32, u32, bool)> = status
        .shapes
        .iter()
        .map(|s| (s.memory_mib, s.vcpus, s.is_default))
        .collect();
    assert_eq!(shapes, vec![(MIB, 1, true), (BIG, 1, false)]);
    assert_eq!(status.guest_reserve_mib, RESERVE);
    assert_eq!(status.pool.len(), 1, "{:?}", status.pool);
    assert_eq!(status.pool[0].memory_mib, MIB);

    // No limits: the default shape, from the pool.
    let vm = node.acquire("").expect("AcquireVm without limits");
    assert!(vm.pooled, "{vm:?}");
    assert!(vm.template_dir.ends_with(&format!("/{small}")), "{vm:?}");
    restore_and_stop(&vm, MIB);

    // The default's guest keeps 16 MiB + 2 MiB (1/32) of its 64 MiB: a
    // 46 MiB limit fits, 47 MiB do not.
    let vm = node.acquire_req(limits(46, 1000)).expect("46 MiB");
    assert!(vm.template_dir.ends_with(&format!("/{small}")), "{vm:?}");
    restore_and_stop(&vm, MIB);
    let vm = node.acquire_req(limits(47, 0)).expect("47 MiB");
    assert!(
        !vm.pooled,
        "no VMM of the larger shape is kept warm: {vm:?}"
    );
    assert!(vm.template_dir.ends_with(&format!("/{big}")), "{vm:?}");
    restore_and_stop(&vm, BIG);

    // An exact shape, if offered.
    let vm = node
        .acquire_req(AcquireVmRequest {
            memory_mib: BIG,
            ..Default::default()
        })
        .expect("an exact shape");
    assert!(vm.template_dir.ends_with(&format!("/{big}")), "{vm:?}");
    restore_and_stop(&vm, BIG);
    wait_until("every handed-over VMM is gone", T, || {
        node.status().handed_pids.is_empty()
    });
}

#[test]
fn a_pod_that_fits_no_shape_or_its_snapshot_is_refused_and_takes_no_vm() {
    let dir = tempfile::tempdir().unwrap();
    let (node, _, big) = shaped_node(dir.path());
    let pooled = node.pooled();

    for (req, code, needles) in [
        (
            limits(109, 0),
            ttrpc::Code::FAILED_PRECONDITION,
            vec![
                "the pod asks for a memory limit of 109 MiB, more than any VM shape of this node \
                 holds (the largest: 128 MiB × 1 vCPU, which holds a memory limit of 108 MiB; \
                 offered: 64 MiB × 1 vCPU, 128 MiB × 1 vCPU; a guest keeps 16 MiB + 1/32 of its \
                 RAM)",
            ],
        ),
        (
            limits(0, 1001),
            ttrpc::Code::FAILED_PRECONDITION,
            vec!["a CPU limit of 1001m (2 vCPUs), more than any VM shape"],
        ),
        (
            AcquireVmRequest {
                memory_mib: 96,
                ..Default::default()
            },
            ttrpc::Code::INVALID_ARGUMENT,
            vec![
                "96 MiB × 1 vCPU × 2 disk slots asked for is not a VM shape of this node; it \
                 offers 64 MiB × 1 vCPU, 128 MiB × 1 vCPU",
            ],
        ),
        (
            AcquireVmRequest {
                memory_mib: MIB,
                ..limits(100, 0)
            },
            ttrpc::Code::FAILED_PRECONDITION,
            vec![
                "more than the VM shape asked for holds (64 MiB × 1 vCPU, which holds a memory \
                 limit of 46 MiB)",
            ],
        ),
        (
            AcquireVmRequest {
                restore_from: big.clone(),
                ..limits(109, 0)
            },
            ttrpc::Code::FAILED_PRECONDITION,
            vec![
                "the pod asks for a memory limit of 109 MiB",
                &format!(
                    "more than snapshot \"{big}\" holds (128 MiB × 1 vCPU, which holds a memory \
                     limit of 108 MiB)"
                ),
            ],
        ),
        (
            AcquireVmRequest {
                restore_from: "absent".into(),
                ..Default::default()
            },
            ttrpc::Code::NOT_FOUND,
            vec!["snapshot \"absent\" is not in this node's store"],
        ),
    ] {
        let (got, msg) = status(node.acquire_req(req.clone()).unwrap_err());
        assert_eq!(got, code, "{req:?}: {msg}");
        for n in needles {
            assert!(msg.contains(n), "{req:?}: {msg}\nwanted: {n}");
        }
    }
    assert!(node.status().handed_pids.is_empty(), "nothing handed over");
    assert_eq!(node.pooled(), pooled, "the pool kept its VMM");

    // A restore-from pod that fits its snapshot gets the snapshot's shape
    // (not the default) and the snapshot's own directory.
    let vm = node
        .acquire_req(AcquireVmRequest {
            restore_from: big.clone(),
            ..limits(108, 0)
        })
        .expect("a pod that fits its snapshot");
    assert!(vm.template_dir.ends_with(&format!("/{big}")), "{vm:?}");
    restore_and_stop(&vm, BIG);
}
