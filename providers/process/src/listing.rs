//! `vkd process list`: what runs, read from the state directory alone.

use std::path::{Path, PathBuf};

use crate::procfs;
use crate::sandbox::Sandbox;

/// One sandbox as `vkd process list` shows it: read from the state directory alone,
/// so it works with the daemon stopped.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Listing {
    pub instance: String,
    #[serde(rename = "podUID")]
    pub pod_uid: String,
    pub namespace: String,
    pub name: String,
    pub node: String,
    pub epoch: u64,
    pub shim_pid: Option<i32>,
    pub shim_alive: bool,
    pub stopping: bool,
    /// `(container, pid)` of every running container process, then
    /// `("other", pid)` for each other live process below the shim: children,
    /// and what detached from its container (re-parented to the shim).
    pub processes: Vec<(String, i32)>,
    /// Why this sandbox's records could not be read (the file is named).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Every instance in the state directory `dir` (the provider's own, `<state>/process`).
pub fn read_listings(dir: &Path) -> std::io::Result<Vec<Listing>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir.join("pods"))?.flatten() {
        if e.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        let sb = Sandbox::new(e.path());
        let unreadable = |path: PathBuf, err: std::io::Error| Listing {
            instance: "?".into(),
            pod_uid: e.file_name().to_string_lossy().into_owned(),
            namespace: "?".into(),
            name: "?".into(),
            node: "?".into(),
            epoch: 0,
            shim_pid: None,
            shim_alive: false,
            stopping: false,
            processes: Vec::new(),
            error: Some(format!("{}: {err}", path.display())),
        };
        let rec = match sb.read_instance() {
            Ok(Some(rec)) => rec,
            Ok(None) => continue,
            Err(err) => {
                out.push(unreadable(sb.instance(), err));
                continue;
            }
        };
        let status = match sb.read_status() {
            Ok(st) => st,
            Err(err) => {
                out.push(unreadable(sb.status(), err));
                continue;
            }
        };
        let shim = sb.shim_process();
        // With namespaces a container's recorded process is the launcher that
        // waits outside them; its program, the one child, is what is shown.
        let mut launchers = Vec::new();
        let mut processes: Vec<(String, i32)> = status
            .map(|st| {
                st.init
                    .iter()
                    .chain(&st.containers)
                    .chain(st.ephemeral.iter().flatten())
                    .filter_map(|c| {
                        let p = c.process.filter(|p| p.alive())?;
                        let program = if procfs::is_launcher(p.pid) {
                            launchers.push(p.pid);
                            crate::procfs::program_of(p.pid)
                        } else {
                            p.pid
                        };
                        Some((c.status.name.clone(), program))
                    })
                    .collect()
            })
            .unwrap_or_default();
        if let Some(s) = shim.filter(|p| p.alive()) {
            for pid in procfs::descendants(s.pid) {
                let launcher_or_known =
                    launchers.contains(&pid) || processes.iter().any(|(_, p)| *p == pid);
                if !launcher_or_known && procfs::stat(pid).is_some_and(|st| st.state != 'Z') {
                    processes.push(("other".into(), pid));
                }
            }
        }
        out.push(Listing {
            instance: rec.id,
            pod_uid: rec.owner.uid,
            namespace: rec.owner.namespace,
            name: rec.owner.name,
            node: rec.node,
            epoch: rec.epoch,
            shim_pid: shim.map(|p| p.pid),
            shim_alive: shim.is_some_and(|p| p.alive()),
            stopping: sb.stop_requested().is_some(),
            processes,
            error: None,
        });
    }
    out.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    Ok(out)
}
