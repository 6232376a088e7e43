//! What a pod's VM is given on the host's side, one module per resource:
//! the containers' rootfs disks on the VM's slots, the pod's network path,
//! the volumes the guest gets (and the watch that keeps them current), and the pod's limits (which choose the
//! VM's shape). Each reads the bundle's spec through [`crate::spec`] and
//! knows nothing of the Task API or of the pod's containers.

pub mod block;
pub mod cgroups;
pub mod limits;
pub mod network;
pub mod port_forward;
pub mod rootfs;
pub mod share;
pub mod volumes;
pub mod watch;
