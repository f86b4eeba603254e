"""The read-only console served on the control plane's admin listener: templates, one stylesheet, and the
small pure helpers the pages need. The app itself is :mod:`llmgw_controlplane.admin`."""
