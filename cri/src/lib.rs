//! `twig-cri`: a Kubernetes CRI v1 (`runtime.v1`) client, and a harness
//! that runs a real containerd with its CRI plugin, a CNI bridge and a
//! local registry, so that tests and benchmarks drive pods exactly as
//! kubelet does — with `runc` today and Twig's shim by changing only the
//! runtime handler.

pub mod client;
pub mod harness;
pub mod logs;

/// The CRI v1 protocol types and gRPC clients (from the `k8s-cri` crate).
pub use k8s_cri::v1 as api;

pub use client::{
    container_config, image_spec, on_node_network, pod_sandbox_config, CriClient, Error, ExecOutput,
};
pub use harness::{HarnessError, Node, NodeOptions, RuntimeHandler};
