//! One file's walk: the items and imports of each module in it, every path it names, its
//! outline `mod x;` declarations, and which code is test code.

use proc_macro2::{Span, TokenStream, TokenTree};
use syn::visit::{self, Visit};
use syn::{Attribute, Item, Meta, Token, UseTree, Visibility, punctuated::Punctuated};

use super::model::{Crate, ModPath, Named, Ref, Scope};

/// An outline `mod x;` found in a file.
pub struct Decl {
    pub module: ModPath,
    pub name: String,
    /// The inline modules around it, within its file.
    pub inline: Vec<String>,
    pub path_attr: Option<String>,
    pub gated: bool,
}

/// Walks the file `krate.files[file]` will be, holding `module`: fills its scopes in `krate`;
/// returns the paths it names and its outline `mod` declarations.
pub fn collect(
    krate: &mut Crate,
    file: usize,
    module: &ModPath,
    ast: &syn::File,
) -> (Vec<Ref>, Vec<Decl>) {
    let mut c = Collector {
        krate,
        file,
        scope: module.clone(),
        file_depth: module.len(),
        test: 0,
        refs: Vec::new(),
        decls: Vec::new(),
    };
    c.visit_file(ast);
    (c.refs, c.decls)
}

/// Whether a `#[cfg(...)]` among `attrs` holds only in tests (`test`), or only in tests and
/// with the `test-support` feature (`support`).
fn cfg_gate(attrs: &[Attribute], support: bool) -> bool {
    fn holds_only_if(meta: &Meta, support: bool) -> bool {
        match meta {
            Meta::Path(p) => p.is_ident("test"),
            Meta::NameValue(nv) => {
                support
                    && nv.path.is_ident("feature")
                    && matches!(&nv.value, syn::Expr::Lit(l) if matches!(&l.lit, syn::Lit::Str(s) if s.value() == "test-support"))
            }
            Meta::List(list) => {
                let Ok(inner) =
                    list.parse_args_with(Punctuated::<Meta, Token![,]>::parse_terminated)
                else {
                    return false;
                };
                let mut each = inner.iter().map(|m| holds_only_if(m, support));
                match list.path.get_ident().map(|i| i.to_string()).as_deref() {
                    Some("all") => each.any(|g| g),
                    Some("any") => inner.iter().count() > 0 && each.all(|g| g),
                    _ => false,
                }
            }
        }
    }
    attrs.iter().filter(|a| a.path().is_ident("cfg")).any(|a| {
        a.parse_args::<Meta>()
            .is_ok_and(|m| holds_only_if(&m, support))
    })
}

fn item_attrs(item: &Item) -> &[Attribute] {
    match item {
        Item::Const(i) => &i.attrs,
        Item::Enum(i) => &i.attrs,
        Item::ExternCrate(i) => &i.attrs,
        Item::Fn(i) => &i.attrs,
        Item::ForeignMod(i) => &i.attrs,
        Item::Impl(i) => &i.attrs,
        Item::Macro(i) => &i.attrs,
        Item::Mod(i) => &i.attrs,
        Item::Static(i) => &i.attrs,
        Item::Struct(i) => &i.attrs,
        Item::Trait(i) => &i.attrs,
        Item::TraitAlias(i) => &i.attrs,
        Item::Type(i) => &i.attrs,
        Item::Union(i) => &i.attrs,
        Item::Use(i) => &i.attrs,
        _ => &[],
    }
}

fn item_name(item: &Item) -> Option<String> {
    let ident = match item {
        Item::Const(i) => &i.ident,
        Item::Enum(i) => &i.ident,
        Item::Fn(i) => &i.sig.ident,
        Item::Macro(i) => i.ident.as_ref()?,
        Item::Static(i) => &i.ident,
        Item::Struct(i) => &i.ident,
        Item::Trait(i) => &i.ident,
        Item::TraitAlias(i) => &i.ident,
        Item::Type(i) => &i.ident,
        Item::Union(i) => &i.ident,
        _ => return None,
    };
    Some(ident.to_string())
}

fn line(span: Span) -> usize {
    span.start().line
}

/// Walks one file: fills its scopes, collects its paths and outline `mod` declarations.
struct Collector<'a> {
    krate: &'a mut Crate,
    file: usize,
    scope: ModPath,
    /// Length of the file's own module path (`scope` is longer inside inline modules).
    file_depth: usize,
    /// How many `#[cfg(test)]`/`#[test]` items enclose the walk.
    test: usize,
    refs: Vec<Ref>,
    decls: Vec<Decl>,
}

impl Collector<'_> {
    fn scope_mut(&mut self) -> &mut Scope {
        self.krate.scopes.entry(self.scope.clone()).or_default()
    }

    /// Makes `segments` absolute; `None` for a path outside the crate (`::std`, too many `super`).
    fn absolute(&self, segments: &[String]) -> Option<Named> {
        let mut base = self.scope.clone();
        let mut rest = segments;
        match segments.first().map(String::as_str) {
            Some("crate") => {
                base.clear();
                rest = &segments[1..];
            }
            Some("self" | "super") => {
                while let Some(first) = rest
                    .first()
                    .map(String::as_str)
                    .filter(|s| *s == "self" || *s == "super")
                {
                    if first == "super" {
                        base.pop()?;
                    }
                    rest = &rest[1..];
                }
            }
            _ => {
                let at = base.len();
                base.extend(rest.iter().cloned());
                return Some(Named {
                    path: base,
                    relative_at: Some(at),
                });
            }
        }
        base.extend(rest.iter().cloned());
        Some(Named {
            path: base,
            relative_at: None,
        })
    }

    fn push_ref(&mut self, segments: &[String], line: usize) {
        let Some(named) = self.absolute(segments) else {
            return;
        };
        let gated = self.krate.scopes.get(&self.scope).is_some_and(|s| s.gated);
        let test_code = self.test > 0 || gated;
        let text = segments.join("::");
        self.refs.push(Ref {
            named,
            line,
            text,
            test_code,
        });
    }

    /// One `use` tree: aliases into the scope; for a private `use`, references too.
    fn use_tree(&mut self, tree: &UseTree, prefix: &mut Vec<String>, private: bool) {
        let (name, alias, at) = match tree {
            UseTree::Path(p) => {
                prefix.push(p.ident.to_string());
                self.use_tree(&p.tree, prefix, private);
                prefix.pop();
                return;
            }
            UseTree::Group(g) => {
                for t in &g.items {
                    self.use_tree(t, prefix, private);
                }
                return;
            }
            UseTree::Glob(g) => {
                if let Some(named) = self.absolute(prefix) {
                    self.scope_mut().globs.push(named);
                }
                if private {
                    let text = format!("{}::*", prefix.join("::"));
                    self.push_glob_ref(prefix, text, line(g.star_token.spans[0]));
                }
                return;
            }
            UseTree::Name(n) => (n.ident.to_string(), n.ident.to_string(), n.ident.span()),
            UseTree::Rename(r) => (r.ident.to_string(), r.rename.to_string(), r.ident.span()),
        };
        let mut full = prefix.clone();
        if name != "self" {
            full.push(name);
        }
        let alias = match alias.as_str() {
            "self" => full.last().cloned().unwrap_or_default(),
            _ => alias,
        };
        if let Some(named) = self.absolute(&full) {
            if alias != "_" {
                self.scope_mut().aliases.insert(alias, named);
            }
            if private {
                self.push_ref(&full, line(at));
            }
        }
    }

    fn push_glob_ref(&mut self, prefix: &[String], text: String, line: usize) {
        self.push_ref(prefix, line);
        if let Some(r) = self.refs.last_mut() {
            r.text = text;
        }
    }

    /// Paths in a macro's tokens: `a::b::c` runs of names (best effort).
    fn scan_tokens(&mut self, tokens: TokenStream) {
        let mut flat = Vec::new();
        flatten(tokens, &mut flat);
        let mut i = 0;
        while i < flat.len() {
            let start = i;
            let mut segments = Vec::new();
            while let Some(TokenTree::Ident(id)) = flat.get(i) {
                segments.push(id.to_string());
                let colons = matches!((flat.get(i + 1), flat.get(i + 2)), (Some(TokenTree::Punct(a)), Some(TokenTree::Punct(b))) if a.as_char() == ':' && b.as_char() == ':');
                i += if colons { 3 } else { 1 };
                if !colons {
                    break;
                }
            }
            let punct = |k: usize, c: char| {
                start >= k && matches!(&flat[start - k], TokenTree::Punct(p) if p.as_char() == c)
            };
            let after_colons = punct(1, ':') && punct(2, ':') || punct(1, '$') || punct(1, '.');
            let lone_self = segments.len() == 1 && segments[0] == "self";
            if !segments.is_empty() && !after_colons && !lone_self {
                let line = line(flat[start].span());
                self.push_ref(&segments, line);
            }
            i = i.max(start + 1);
        }
    }
}

fn flatten(tokens: TokenStream, out: &mut Vec<TokenTree>) {
    for t in tokens {
        match t {
            TokenTree::Group(g) => {
                out.push(TokenTree::Punct(proc_macro2::Punct::new(
                    ';',
                    proc_macro2::Spacing::Alone,
                )));
                flatten(g.stream(), out);
                out.push(TokenTree::Punct(proc_macro2::Punct::new(
                    ';',
                    proc_macro2::Spacing::Alone,
                )));
            }
            t => out.push(t),
        }
    }
}

impl<'ast> Visit<'ast> for Collector<'_> {
    fn visit_item(&mut self, item: &'ast Item) {
        let attrs = item_attrs(item);
        let test = cfg_gate(attrs, false) || attrs.iter().any(|a| a.path().is_ident("test"));
        if let Some(name) = item_name(item) {
            self.scope_mut().defined.insert(name);
        }
        self.test += usize::from(test);
        visit::visit_item(self, item);
        self.test -= usize::from(test);
    }

    fn visit_item_mod(&mut self, m: &'ast syn::ItemMod) {
        let name = m.ident.to_string();
        let mut module = self.scope.clone();
        module.push(name.clone());
        let gated =
            self.krate.scopes.get(&self.scope).is_some_and(|s| s.gated) || cfg_gate(&m.attrs, true);
        let Some((_, items)) = &m.content else {
            let path_attr = m
                .attrs
                .iter()
                .filter(|a| a.path().is_ident("path"))
                .find_map(|a| match &a.meta {
                    Meta::NameValue(nv) => match &nv.value {
                        syn::Expr::Lit(syn::ExprLit {
                            lit: syn::Lit::Str(s),
                            ..
                        }) => Some(s.value()),
                        _ => None,
                    },
                    _ => None,
                });
            let inline = self.scope[self.file_depth..].to_vec();
            self.decls.push(Decl {
                module,
                name,
                inline,
                path_attr,
                gated,
            });
            return;
        };
        self.krate.scopes.insert(
            module.clone(),
            Scope {
                file: self.file,
                gated,
                ..Scope::default()
            },
        );
        let outer = std::mem::replace(&mut self.scope, module);
        for attr in &m.attrs {
            self.visit_attribute(attr);
        }
        for item in items {
            self.visit_item(item);
        }
        self.scope = outer;
    }

    fn visit_item_use(&mut self, u: &'ast syn::ItemUse) {
        if u.leading_colon.is_none() {
            let private = matches!(u.vis, Visibility::Inherited);
            self.use_tree(&u.tree, &mut Vec::new(), private);
        }
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        if path.leading_colon.is_none() {
            let segments: Vec<String> = path.segments.iter().map(|s| s.ident.to_string()).collect();
            if let Some(first) = path.segments.first() {
                self.push_ref(&segments, line(first.ident.span()));
            }
        }
        visit::visit_path(self, path);
    }

    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        self.scan_tokens(mac.tokens.clone());
        visit::visit_macro(self, mac);
    }

    /// `pub(in crate::x)` names no dependency.
    fn visit_vis_restricted(&mut self, _: &'ast syn::VisRestricted) {}
}
