//! `twig-snapshotter`: Twig's storage on a node.
//!
//! * [`store::SnapshotStore`] keeps containerd snapshots as ext4 image files
//!   on a reflink-capable filesystem; a child is a FICLONE reflink of its
//!   parent. [`service`] serves it as containerd's snapshots gRPC API (a
//!   `proxy_plugins` snapshotter) on a Unix socket; the `twig-snapshotter`
//!   binary runs that server.
//!
//! The node store for VM snapshots and the filesystem primitives (FICLONE,
//! sparse copy, no-replace rename) live in `twig-store`, shared with twig-vmm.

pub mod error;
pub mod filter;
pub mod service;
pub mod store;

pub use error::{Error, Result};
pub use store::{block_image, Info, Kind, Mount, SnapshotStore, StoreOptions};
pub use twig_store::fsops::{CloneMode, Usage};

/// Generated gRPC bindings of containerd's snapshots API (client and server).
/// The generated items carry the .proto's comments, which containerd's
/// snapshots.proto leaves off most fields.
#[allow(missing_docs)]
pub mod api {
    pub use self::containerd::services::snapshots::v1 as snapshots;
    pub use self::containerd::types;

    /// Modules nested as the protobuf packages are, so generated paths resolve.
    pub mod containerd {
        /// `containerd.types`.
        pub mod types {
            tonic::include_proto!("containerd.types");
        }
        /// `containerd.services`.
        pub mod services {
            /// `containerd.services.snapshots`.
            pub mod snapshots {
                /// `containerd.services.snapshots.v1`.
                pub mod v1 {
                    tonic::include_proto!("containerd.services.snapshots.v1");
                }
            }
        }
    }
}
