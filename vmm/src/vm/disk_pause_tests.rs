//! A guest cannot block its own pauses with disk I/O: the vCPU's notify
//! returns at once, the disk's I/O worker does the (held, slow) write, and
//! a pause either waits for the request to finish (and then holds a
//! consistent queue: the request in the used ring) or is withdrawn within
//! its bound with the VM still running. The host plays the guest's
//! virtio-blk driver through the VM's MMIO dispatch, from a thread standing
//! in for the vCPU.

use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use virtio_bindings::virtio_blk::VIRTIO_BLK_T_OUT;
use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_ACKNOWLEDGE, VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK,
    VIRTIO_CONFIG_S_FEATURES_OK,
};
use virtio_bindings::virtio_mmio::{
    VIRTIO_MMIO_DEVICE_FEATURES, VIRTIO_MMIO_DEVICE_FEATURES_SEL, VIRTIO_MMIO_DRIVER_FEATURES,
    VIRTIO_MMIO_DRIVER_FEATURES_SEL, VIRTIO_MMIO_QUEUE_AVAIL_LOW, VIRTIO_MMIO_QUEUE_DESC_LOW,
    VIRTIO_MMIO_QUEUE_NOTIFY, VIRTIO_MMIO_QUEUE_NUM, VIRTIO_MMIO_QUEUE_READY,
    VIRTIO_MMIO_QUEUE_SEL, VIRTIO_MMIO_QUEUE_USED_LOW, VIRTIO_MMIO_STATUS,
};

use crate::devices::Devices;
use crate::error::{Error, ErrorKind};
use crate::testguest::{self, Command};
use crate::vcpu::PARK_TIMEOUT;
use crate::virtio::testing::FakeQueue;
use crate::virtio::{MMIO_BASE, MMIO_SIZE};
use crate::vm::failpoint;
use crate::vm::{DeviceConfig, DiskConfig, RunState, Shape, Vm};

const T: Duration = Duration::from_secs(20);
/// The disk is the second device, after the entropy device.
const BASE: u64 = MMIO_BASE + MMIO_SIZE;
const QUEUE: u64 = testguest::SCRATCH;
const HEADER: u64 = testguest::SCRATCH + 0x10_0000;
const DATA: u64 = HEADER + 0x1000;
const STATUS: u64 = DATA + 0x10_0000;
const LEN: u32 = 64 * 1024;

fn set(devices: &Devices, off: u32, v: u32) {
    devices.mmio_write(BASE + u64::from(off), &v.to_le_bytes());
}

fn reg(devices: &Devices, off: u32) -> u32 {
    let mut b = [0u8; 4];
    devices.mmio_read(BASE + u64::from(off), &mut b);
    u32::from_le_bytes(b)
}

/// Brings the disk's queue up as the guest's driver would.
fn bring_up(devices: &Devices) -> FakeQueue {
    let q = FakeQueue::new(QUEUE, 16, 0x1000);
    let mut status = VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER;
    set(devices, VIRTIO_MMIO_STATUS, status);
    for half in 0..2 {
        set(devices, VIRTIO_MMIO_DEVICE_FEATURES_SEL, half);
        let f = reg(devices, VIRTIO_MMIO_DEVICE_FEATURES);
        set(devices, VIRTIO_MMIO_DRIVER_FEATURES_SEL, half);
        set(devices, VIRTIO_MMIO_DRIVER_FEATURES, f);
    }
    status |= VIRTIO_CONFIG_S_FEATURES_OK;
    set(devices, VIRTIO_MMIO_STATUS, status);
    set(devices, VIRTIO_MMIO_QUEUE_SEL, 0);
    set(devices, VIRTIO_MMIO_QUEUE_NUM, 16);
    set(devices, VIRTIO_MMIO_QUEUE_DESC_LOW, QUEUE as u32);
    set(devices, VIRTIO_MMIO_QUEUE_AVAIL_LOW, q.avail_ring() as u32);
    set(devices, VIRTIO_MMIO_QUEUE_USED_LOW, q.used_ring() as u32);
    set(devices, VIRTIO_MMIO_QUEUE_READY, 1);
    set(
        devices,
        VIRTIO_MMIO_STATUS,
        status | VIRTIO_CONFIG_S_DRIVER_OK,
    );
    q
}

/// Posts a 64 KiB write of `byte` at sector 0 and notifies from another
/// thread (the vCPU's part); asserts that the notify returns at once.
fn write_request(vm: &Vm, q: &mut FakeQueue, byte: u8) {
    let mut h = VIRTIO_BLK_T_OUT.to_le_bytes().to_vec();
    h.extend_from_slice(&[0; 12]);
    vm.write_guest(HEADER, &h).unwrap();
    vm.write_guest(DATA, &vec![byte; LEN as usize]).unwrap();
    vm.write_guest(STATUS, &[0xff]).unwrap();
    q.post(
        vm.ram.memory(),
        &[(HEADER, 16, false), (DATA, LEN, false), (STATUS, 1, true)],
    );
    let devices = Arc::clone(&vm.devices);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        set(&devices, VIRTIO_MMIO_QUEUE_NOTIFY, 0);
        let _ = tx.send(());
    });
    rx.recv_timeout(Duration::from_secs(1))
        .expect("the notify returns at once, whatever the disk does");
}

fn counter(vm: &Vm) -> u64 {
    vm.read_u64(testguest::COUNTER).unwrap()
}

#[test]
fn a_slow_disk_write_neither_blocks_the_vcpu_nor_freezes_a_pause() {
    if let Err(e) = crate::vm::open_kvm() {
        panic!("this test needs a usable /dev/kvm (run as root on a KVM host): {e}");
    }
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk.img");
    std::fs::write(&img, vec![0u8; 1 << 20]).unwrap();
    let config = DeviceConfig {
        disks: vec![DiskConfig {
            path: img.clone(),
            read_only: false,
        }],
        ..DeviceConfig::default()
    };
    let mut vm = Vm::create_with(Shape::new(32, 1), Box::new(std::io::sink()), &config).unwrap();
    let kernel = testguest::write_to(dir.path()).unwrap();
    vm.boot(&kernel, "console=ttyS0").unwrap();
    testguest::wait_booted(&vm, T).unwrap();
    testguest::post(&mut vm, Command::Spin, [0; 3]).unwrap();
    let mut q = bring_up(&vm.devices);

    // The write is held on the host for longer than a pause waits.
    failpoint::hold("blk-write");
    write_request(&vm, &mut q, 0x5a);
    testguest::poll(T, "the disk worker to be held in the write", || {
        Ok(failpoint::stalled() == 1)
    })
    .unwrap();
    let start = Instant::now();
    let e = vm.pause().expect_err("the request cannot finish");
    let took = start.elapsed();
    failpoint::release("blk-write");
    assert!(took < PARK_TIMEOUT + Duration::from_secs(2), "{took:?}");
    assert!(matches!(e, Error::PauseTimedOut { .. }), "{e}");
    assert_eq!(e.kind(), ErrorKind::Refused, "{e}");
    assert!(e.to_string().contains("disk 0"), "{e}");
    assert_eq!(vm.state(), RunState::Running);
    let c = counter(&vm);
    testguest::poll(T, "the guest to run on", || Ok(counter(&vm) > c)).unwrap();
    testguest::poll(T, "the write to complete", || {
        Ok(q.used(vm.ram.memory()).is_some())
    })
    .unwrap();
    let mut status = [0u8];
    vm.read_guest(STATUS, &mut status).unwrap();
    assert_eq!(status[0], 0, "VIRTIO_BLK_S_OK");
    assert_eq!(
        std::fs::read(&img).unwrap()[..LEN as usize],
        [0x5a; LEN as usize]
    );

    // Held for less than the bound: the pause waits for the request and
    // holds a queue with the request used, its status written.
    failpoint::hold("blk-write");
    write_request(&vm, &mut q, 0xa5);
    testguest::poll(T, "the disk worker to be held again", || {
        Ok(failpoint::stalled() == 1)
    })
    .unwrap();
    let releaser = std::thread::spawn(|| {
        std::thread::sleep(Duration::from_millis(500));
        failpoint::release("blk-write");
    });
    vm.pause().expect("the pause waits for the request");
    releaser.join().unwrap();
    assert_eq!(vm.state(), RunState::Paused);
    assert!(q.used(vm.ram.memory()).is_some(), "used before the pause");
    vm.read_guest(STATUS, &mut status).unwrap();
    assert_eq!(status[0], 0);
    assert_eq!(
        std::fs::read(&img).unwrap()[..LEN as usize],
        [0xa5; LEN as usize]
    );
    let held = counter(&vm);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(counter(&vm), held, "a paused guest does not run");
    vm.resume().unwrap();
    testguest::poll(T, "the guest to run again", || Ok(counter(&vm) > held)).unwrap();
}
