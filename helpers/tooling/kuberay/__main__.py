"""`python -m helpers.tooling.kuberay --install-helm` (`make install`): the pinned `helm` into the virtualenv."""

import sys

from helpers.tooling.kuberay.helm import install_helm

if sys.argv[1:] != ["--install-helm"]:
    sys.exit("usage: python -m helpers.tooling.kuberay --install-helm")
install_helm()
