//! Chooses the data plane's address from a network interface name (`BURN_DDP_SOCKET_IFNAME`,
//! `GLOO_SOCKET_IFNAME`), as Gloo and NCCL let users pick the fabric on multi-homed nodes.

use std::net::IpAddr;

use crate::error::{DdpError, Result};

/// The address of interface `name` to listen on and advertise: its first address of the same
/// family as `like` (the address that reaches the store), else its first address. Only the
/// first entry of a comma-separated list is used (Gloo accepts several; burn-ddp uses one).
pub(crate) fn interface_addr(name: &str, like: IpAddr) -> Result<IpAddr> {
    let name = name.split(',').next().unwrap_or_default().trim();
    let interfaces =
        if_addrs::get_if_addrs().map_err(|e| DdpError::io("listing the network interfaces", e))?;
    choose(
        name,
        like,
        interfaces.iter().map(|i| (i.name.as_str(), i.ip())),
    )
}

/// [`interface_addr`] over a given list of `(interface, address)` pairs.
fn choose<'a>(
    name: &str,
    like: IpAddr,
    interfaces: impl Iterator<Item = (&'a str, IpAddr)> + Clone,
) -> Result<IpAddr> {
    let mine: Vec<IpAddr> = interfaces
        .clone()
        .filter(|(n, _)| *n == name)
        .map(|(_, ip)| ip)
        .collect();
    if let Some(ip) = mine
        .iter()
        .find(|ip| ip.is_ipv4() == like.is_ipv4())
        .or(mine.first())
    {
        return Ok(*ip);
    }
    let mut known: Vec<(&str, Vec<String>)> = Vec::new();
    for (n, ip) in interfaces {
        match known.iter_mut().find(|(k, _)| *k == n) {
            Some((_, ips)) => ips.push(ip.to_string()),
            None => known.push((n, vec![ip.to_string()])),
        }
    }
    let listed: Vec<String> = known
        .iter()
        .map(|(n, ips)| format!("{n} ({})", ips.join(", ")))
        .collect();
    Err(DdpError::InvalidConfig(format!(
        "no network interface named {name:?} with an IP address, asked for by \
         BURN_DDP_SOCKET_IFNAME or GLOO_SOCKET_IFNAME (or socket_ifname); the interfaces here \
         are: {}",
        if listed.is_empty() {
            "none".to_string()
        } else {
            listed.join(", ")
        }
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIST: [(&str, &str); 4] = [
        ("lo", "127.0.0.1"),
        ("lo", "::1"),
        ("eth0", "fe80::1"),
        ("eth0", "10.0.0.2"),
    ];

    fn pick(name: &str, like: &str) -> Result<IpAddr> {
        let list = LIST.iter().map(|(n, ip)| (*n, ip.parse().unwrap()));
        choose(name, like.parse().unwrap(), list)
    }

    #[test]
    fn the_family_of_the_store_address_comes_first() {
        assert_eq!(pick("eth0", "127.0.0.1").unwrap().to_string(), "10.0.0.2");
        assert_eq!(pick("eth0", "::1").unwrap().to_string(), "fe80::1");
        assert_eq!(pick("lo", "::1").unwrap().to_string(), "::1");
    }

    #[test]
    fn an_unknown_name_lists_the_interfaces() {
        let e = pick("ib0", "127.0.0.1").unwrap_err().to_string();
        assert!(
            e.contains("\"ib0\"") && e.contains("BURN_DDP_SOCKET_IFNAME"),
            "{e}"
        );
        assert!(
            e.contains("lo (127.0.0.1, ::1), eth0 (fe80::1, 10.0.0.2)"),
            "{e}"
        );
    }

    #[test]
    fn the_real_loopback_is_found() {
        let ip = interface_addr("lo", "127.0.0.1".parse().unwrap()).unwrap();
        assert!(ip.is_loopback(), "{ip}");
        let e = interface_addr("no-such-if0", "127.0.0.1".parse().unwrap()).unwrap_err();
        assert!(e.to_string().contains("lo ("), "{e}");
    }
}
