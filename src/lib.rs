//! vkd: a Virtual Kubelet provider daemon.
