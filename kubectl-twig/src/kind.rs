//! The Twig kinds the plugin names on the command line and in its output.

use kube::api::{Api, DynamicObject};
use kube::discovery::ApiResource;
use kube::Client;
use twig_controller::crd::{PodClone, Rollback, Snapshot};

use crate::error::Error;

/// A Twig kind with conditions (`Ready`, `Progressing`, `Failure`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `Snapshot`.
    Snapshot,
    /// `Clone`.
    Clone,
    /// `Rollback`.
    Rollback,
}

impl Kind {
    /// The kind named as kubectl accepts it: singular, plural or short name,
    /// with or without `.twig.dev`, any case.
    pub fn parse(text: &str) -> Result<Self, Error> {
        let lower = text.to_ascii_lowercase();
        let bare = lower.strip_suffix(".twig.dev").unwrap_or(&lower);
        match bare {
            "snapshot" | "snapshots" | "tsnap" => Ok(Kind::Snapshot),
            "clone" | "clones" | "tclone" => Ok(Kind::Clone),
            "rollback" | "rollbacks" | "trb" => Ok(Kind::Rollback),
            "sandboxtemplate" | "sandboxtemplates" | "ttpl" => Err(Error::Usage(format!(
                "{text} has no conditions to wait for; use kubectl wait --for=jsonpath='{{.status.readyNodes}}'=N"
            ))),
            _ => Err(Error::Usage(format!(
                "the server doesn't have a Twig resource type \"{text}\" (use snapshot, clone or rollback)"
            ))),
        }
    }

    /// The kind's API resource (group, version, plural).
    pub fn api_resource(self) -> ApiResource {
        match self {
            Kind::Snapshot => ApiResource::erase::<Snapshot>(&()),
            Kind::Clone => ApiResource::erase::<PodClone>(&()),
            Kind::Rollback => ApiResource::erase::<Rollback>(&()),
        }
    }

    /// A dynamic API of this kind in `namespace`.
    pub fn api(self, client: Client, namespace: &str) -> Api<DynamicObject> {
        Api::namespaced_with(client, namespace, &self.api_resource())
    }

    /// `snapshot.twig.dev/<name>`: how kubectl names an object in its output.
    pub fn object_name(self, name: &str) -> String {
        let resource = self.api_resource();
        format!(
            "{}.{}/{name}",
            resource.kind.to_ascii_lowercase(),
            resource.group
        )
    }

    /// `snapshots/<name>`: how `kubectl wait` names an object in its errors.
    pub fn plural_name(self, name: &str) -> String {
        format!("{}/{name}", self.api_resource().plural)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert_eq!(Kind::parse("Snapshots.twig.dev").ok(), Some(Kind::Snapshot));
        assert_eq!(Kind::parse("tclone").ok(), Some(Kind::Clone));
        assert_eq!(Kind::parse("rollback").ok(), Some(Kind::Rollback));
        assert!(Kind::parse("pod").is_err());
        assert_eq!(Kind::Clone.object_name("x"), "clone.twig.dev/x");
        assert_eq!(Kind::Rollback.plural_name("x"), "rollbacks/x");
    }
}
